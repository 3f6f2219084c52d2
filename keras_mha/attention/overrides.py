"""What a `with` block overrides for the calls inside it (a path, a
computation, a platform): the value, checked, held on a stack."""

import contextlib


@contextlib.contextmanager
def held(stack, name, value, choices):
    """Holds `value` on `stack` inside the block, innermost last.

    `stack` is a plain list, which `torch.compile` reads as a constant (a
    `ContextVar` is a graph break); its readers take `stack[-1]`.

    Args:
        stack: the list of the values held.
        name: the argument's name, for the error.
        value: the value; a `ValueError` unless one of `choices`.
        choices: the values allowed.
    """
    if value not in choices:
        raise ValueError(
            f"`{name}` must be one of {choices}. Received: {name}={value!r}"
        )
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()
