import torch
import torch.nn.functional as F


class Compose:
    def __init__(self, steps):
        self.steps = steps

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x


class ToTensor:
    def __call__(self, x):
        return x  # the stand-in datasets already give float tensors in [0, 1]


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


class Resize:
    def __init__(self, size):
        self.size = size

    def __call__(self, x):
        return F.interpolate(x[None], size=(self.size, self.size), mode="bilinear", align_corners=False)[0]


class CenterCrop:
    def __init__(self, size):
        self.size = size

    def __call__(self, x):
        top, left = (x.shape[-2] - self.size) // 2, (x.shape[-1] - self.size) // 2
        return x[..., top:top + self.size, left:left + self.size]
