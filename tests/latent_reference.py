"""A float64 NumPy reference of multi-head latent attention, written from
the DeepSeek-V2 paper (arXiv 2405.04434, section 2.1), eq. 9-19:

    c_kv = RMSNorm(W_dkv h)                  the latent (kv_lora_rank)
    k_C  = W_uk c_kv,  v_C = W_uv c_kv       per-head keys and values
    k_R  = RoPE(W_kr h)                      one rotated key for all heads
    c_q  = RMSNorm(W_dq h)  (or h itself)    the query's own compression
    q_C  = W_uq c_q,  q_R = RoPE(W_qr c_q)   per head
    q_n = [q_C,n ; q_R,n],  k_n = [k_C,n ; k_R]
    o_n = sum_j softmax_j(q_n·k_n,j · scale) v_C,n,j
    u   = W_o [o_1 ; ... ; o_N]      (each o_n times sigmoid(W_g,n h) with
                                      a gate)

Everything expanded per head, looped over nothing clever; the masks and
the row rule (no allowed key: weights 0) are those of `reference.py`.
"""

import numpy as np

from reference import rotate


def latent_weights(layer):
    """The layer's weights as float64 arrays, by sublayer name."""
    f64 = lambda v: np.asarray(v.numpy(), dtype="float64")  # noqa: E731
    weights = {}
    for sub in layer._layers:
        for variable in sub.weights:
            weights[f"{sub.name}/{variable.name}"] = f64(variable)
    return weights


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _dense(weights, name, x, equation):
    y = np.einsum(equation, x, weights[f"{name}/kernel"])
    bias = weights.get(f"{name}/bias")
    return y if bias is None else y + bias


def reference_latent_attention(
    weights, config, query, value, query_mask=None, value_mask=None,
    attention_mask=None, use_causal_mask=False, sliding_window=None,
    query_offset=0, rotary=None, soft_cap=None,
):
    """`(output, weights)` of multi-head latent attention, float64.

    Args:
        weights: `latent_weights(layer)`.
        config: the layer's `get_config()` (sizes, `q_lora_rank`, `scale`,
            `norm_epsilon`).
        query: `(B, T, E)`; value `(B, S, E_v)`.
        rotary: `None`, or the keyword arguments of `reference.rotate`.
        Other arguments as in `reference.reference_attention`.
    """
    query = np.asarray(query, "float64")
    value = np.asarray(value, "float64")
    nope = config["qk_nope_head_dim"]
    rope = config["qk_rope_head_dim"]
    rank = config["kv_lora_rank"]
    eps = config["norm_epsilon"]
    scale = config["scale"] or (nope + rope) ** -0.5
    if config["q_lora_rank"] is None:
        q = _dense(weights, "query", query, "btd,dnh->btnh")
    else:
        c_q = _dense(weights, "query_a", query, "btd,dr->btr")
        c_q = _rms(c_q, weights["query_norm/scale"], eps)
        q = _dense(weights, "query_b", c_q, "btr,rnh->btnh")
    compressed = _dense(weights, "kv_a", value, "btd,dr->btr")
    c_kv = _rms(compressed[..., :rank], weights["kv_norm/scale"], eps)
    k_rope = compressed[..., rank:][:, :, None]  # (B, S, 1, P)
    kv = _dense(weights, "kv_b", c_kv, "bsr,rnh->bsnh")
    k_nope, v = kv[..., :nope], kv[..., nope:]
    batch, t_len, num_heads, _ = q.shape
    s_len = value.shape[1]
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    if rotary is not None:
        q_rope = rotate(q_rope, query_offset + np.arange(t_len), **rotary)
        k_rope = rotate(k_rope, np.arange(s_len), **rotary)
    q = np.concatenate([q_nope, q_rope], -1)
    k = np.concatenate(
        [k_nope, np.repeat(k_rope, num_heads, axis=2)], -1
    )  # (B, S, N, Hn + P)

    allowed = np.ones((batch, num_heads, t_len, s_len), bool)
    pos = query_offset + np.arange(t_len)[:, None]
    col = np.arange(s_len)[None, :]
    if use_causal_mask:
        allowed &= col <= pos
    if isinstance(sliding_window, (tuple, list)):
        left, right = sliding_window
        allowed &= (col >= pos - left) & (col <= pos + right)
    elif sliding_window is not None:
        allowed &= np.abs(pos - col) < sliding_window
    if query_mask is not None:
        allowed &= np.asarray(query_mask, bool)[:, None, :, None]
    if value_mask is not None:
        allowed &= np.asarray(value_mask, bool)[:, None, None, :]
    if attention_mask is not None:
        m = np.asarray(attention_mask, bool)
        allowed &= m[:, None] if m.ndim == 3 else m
    scores = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * np.tanh(scores / soft_cap)
    probs = np.zeros_like(scores)
    for index in np.ndindex(batch, num_heads, t_len):
        row = allowed[index]
        if row.any():
            e = np.exp(scores[index][row] - scores[index][row].max())
            probs[index][row] = e / e.sum()
    context = np.einsum("bnts,bsnv->btnv", probs, v)
    if config.get("use_gate"):
        gate = _dense(weights, "gate", query, "btd,dnv->btnv")
        context = context / (1.0 + np.exp(-gate))
    out = _dense(weights, "attention_output", context, "btnv,nve->bte")
    return out, probs
