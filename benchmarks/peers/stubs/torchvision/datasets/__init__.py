"""Stub (see torchvision/__init__.py): the base class streaming.vision subclasses."""

from torch.utils.data import Dataset


class VisionDataset(Dataset):
    def __init__(self, root=None, transforms=None, transform=None, target_transform=None):
        self.root, self.transform, self.target_transform = root, transform, target_transform
        self.transforms = transforms
