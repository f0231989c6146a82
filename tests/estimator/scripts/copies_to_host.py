"""Each step copies a GPU gradient into a host buffer, as DeepSpeed's optimizer offload does
(stage_1_and_2.py, ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``:
``dest_tensor.copy_(src_tensor, non_blocking=True)`` into a view of the host fp32 gradient)."""

import torch

model = torch.nn.Linear(1024, 1024).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
host = torch.zeros(2_000_000, device="cpu")  # larger than the gradient: a flat host buffer
for _ in range(5):
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    gradient = model.weight.grad.view(-1).float()
    host.narrow(0, 0, gradient.numel()).copy_(gradient, non_blocking=True)
    optimizer.step()
    optimizer.zero_grad()
