"""A depthwise-separable block twice, in NCHW and channels-last, fp32, with cudnn.benchmark and
deterministic on: PyTorch runs the NCHW depthwise convolution on its own kernel, the
channels-last one on cuDNN."""

import torch

torch.backends.cudnn.benchmark = True
torch.backends.cudnn.deterministic = True


def block():
    return torch.nn.Sequential(torch.nn.Conv2d(32, 32, 3, padding=1, groups=32),
                               torch.nn.Conv2d(32, 64, 1)).cuda()


nchw, nhwc = block(), block().to(memory_format=torch.channels_last)
opt = torch.optim.SGD([*nchw.parameters(), *nhwc.parameters()], lr=0.1)
for _ in range(3):
    x = torch.randn(2, 32, 16, 16, device="cuda", requires_grad=True)
    opt.zero_grad()
    (nchw(x).sum() + nhwc(x.to(memory_format=torch.channels_last)).sum()).backward()
    opt.step()
