"""`keras-mha demo`: two heads of one layer attend to different tokens.

The sentence "банк у реки" ("bank by the river") is fed as one-hot vectors,
so row `j` of each projection kernel is token `j`'s projection. The query and
key kernels are set by hand:

    token "банк", head 1: query [3, 0]; keys банк [3, 0], у [0, 1], реки [0, 1]
    token "банк", head 2: query [0, 3]; keys банк [0, 0], у [0, 1], реки [0, 3]

Head 1 therefore matches "банк" with itself, head 2 with "реки" (which bank
is meant). The weights printed are the layer's own, on the active backend:
softmax(q·k / sqrt(2)) over the three keys.
"""

import numpy as np

from keras_mha.cli.common import INSTALL_PLOT
from keras_mha.cli.common import CLIError
from keras_mha.cli.common import check_plot

TOKENS = ("банк", "у", "реки")

# (E, N, H) = (token, head, component): row j is token j's projection.
QUERY_KERNEL = np.array(
    [
        [[3, 0], [0, 3]],  # банк
        [[0, 3], [0, 0]],  # у: head 2 has no preference (uniform)
        [[3, 0], [0, 3]],  # реки
    ],
    dtype="float32",
)
KEY_KERNEL = np.array(
    [
        [[3, 0], [0, 0]],  # банк
        [[0, 1], [0, 1]],  # у
        [[0, 1], [0, 3]],  # реки
    ],
    dtype="float32",
)
# Values and the output projection play no part in the weights; these just
# make the output readable (each head writes its tokens' identities).
VALUE_KERNEL = np.array(
    [
        [[1, 0], [1, 0]],  # банк
        [[0, 1], [0, 1]],  # у
        [[1, 1], [1, 1]],  # реки
    ],
    dtype="float32",
)
OUTPUT_KERNEL = np.array(  # (N, V, E)
    [
        [[1, 0, 0], [0, 1, 0]],
        [[0, 0, 1], [0, 1, 0]],
    ],
    dtype="float32",
)



def attention_weights():
    """The layer's attention weights `(N, T, S)` = `(2, 3, 3)` for the demo."""
    import keras

    from keras_mha import MultiHeadAttention

    inputs = np.eye(len(TOKENS), dtype="float32")[None]  # (B, T, E) = (1, 3, 3)
    layer = MultiHeadAttention(
        num_heads=2, key_dim=2, use_bias=False, kernel_initializer="zeros"
    )
    layer.build(inputs.shape, inputs.shape)
    layer.query_dense.kernel.assign(QUERY_KERNEL)
    layer.key_dense.kernel.assign(KEY_KERNEL)
    layer.value_dense.kernel.assign(VALUE_KERNEL)
    layer.output_dense.kernel.assign(OUTPUT_KERNEL)
    _, scores = layer(inputs, inputs, return_attention_scores=True)
    return keras.ops.convert_to_numpy(scores)[0]  # (N, T, S)


def run(plot=None):
    """Prints the weights of "банк" per head; draws all of them to `plot`."""
    import keras

    if plot is not None:
        check_plot(plot)
    weights = attention_weights()
    word = 0
    print(f'Attention weights of "{TOKENS[word]}" in "{" ".join(TOKENS)}" '
          "(bank by the river):")
    for head, row in enumerate(weights[:, word, :], start=1):
        cells = ", ".join(f"{t}={w:.2f}" for t, w in zip(TOKENS, row))
        print(f"head {head}: {cells}")
    focus = [TOKENS[i] for i in weights[:, word, :].argmax(axis=-1)]
    backend = keras.backend.backend()
    where = f"(backend {backend}, keras {keras.__version__})"
    if len(set(focus)) > 1:
        targets = ", ".join(f'head {n} on "{t}"' for n, t in
                            enumerate(focus, start=1))
        print(f"Different heads attend to different tokens: {targets} {where}")
    else:
        print(f'All heads attend most to "{focus[0]}" {where}')
    if plot is not None:
        save_plot(weights, plot)
        print(f"Attention maps written to {plot}")
    return 0


def save_plot(weights, path):
    """Draws each head's `(T, S)` weights side by side into `path`."""
    try:
        import matplotlib
    except ImportError:
        raise CLIError(f"--plot needs matplotlib: {INSTALL_PLOT}")
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    num_heads = weights.shape[0]
    figure, axes = plt.subplots(
        1, num_heads, figsize=(3.6 * num_heads + 1, 3.6), layout="constrained"
    )
    figure.suptitle(" ".join(TOKENS) + " (bank by the river)")
    for head, ax in enumerate(np.atleast_1d(axes)):
        image = ax.imshow(weights[head], vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(f"head {head + 1}")
        ax.set_xticks(range(len(TOKENS)), TOKENS)
        ax.set_yticks(range(len(TOKENS)), TOKENS)
        ax.set_xlabel("key")
        if head == 0:
            ax.set_ylabel("query")
        for (t, s), w in np.ndenumerate(weights[head]):
            ax.text(s, t, f"{w:.2f}", ha="center", va="center",
                    color="black" if w > 0.5 else "white")
    figure.colorbar(image, ax=axes, shrink=0.8)
    try:
        figure.savefig(path)
    except (OSError, ValueError) as error:
        raise CLIError(f"cannot write plot to {path}: {_reason(error)}")
    finally:
        plt.close(figure)


def _reason(error):
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error).strip().splitlines()[0]
