"""A parameter whose data is freed to an empty tensor on its device between uses and gathered
again from a partition, as DeepSpeed ZeRO-3 does (partition_parameters.py: ``free_param`` sets
``param.data = torch.empty(0, dtype=param.dtype, device=param.device)``; the next all-gather
makes a new tensor on ``param.device``). Prints where the freed parameter and the gathered copy
live."""

import torch

embedding = torch.nn.Embedding(4096, 256).cuda()
weight = embedding.weight
partition = weight.data.clone()  # what this rank keeps between uses
optimizer = torch.optim.SGD([weight], lr=0.1)
for _step in range(5):
    weight.data = partition.to(weight.device)  # gathered
    tokens = torch.randint(0, 4096, (8, 32), device="cuda")
    embedding(tokens).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)  # freed
    print("freed:", weight.device.type, weight.is_cuda, partition.to(weight.device).is_cuda,
          flush=True)
