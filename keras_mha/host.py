"""Host-side helpers of the weight importers (`convert.py`,
`huggingface.py`): source tensors to NumPy, `output_shape` as a tuple."""

import numpy as np


def to_numpy(tensor):
    """A torch tensor (any device, bfloat16 too) or array -> NumPy."""
    if hasattr(tensor, "detach"):  # a torch tensor; NumPy has no bfloat16
        tensor = tensor.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            tensor = tensor.float()
        return tensor.numpy()
    return np.asarray(tensor)


def output_shape(value):
    """`output_shape` as given to a layer -> a tuple, or `None`."""
    if value is None or isinstance(value, (tuple, list)):
        return None if value is None else tuple(value)
    return (value,)
