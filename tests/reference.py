"""An independent float64 NumPy reference of the whole layer.

Loops over nothing clever: project, rotate (RoPE), score, modify the
logits (soft-cap, bias, ALiBi), mask, softmax over the allowed keys (with
a sink logit in the denominator; rows with no key get zeros), weighted
sum, gate, norm, output projection. The features follow their papers:

- RoPE (Su et al., rotate-half pairing of GPT-NeoX/Llama): the pair
  `(x_i, x_{i+d/2})` is the complex number `x_i + i·x_{i+d/2}` turned by
  `e^{i·p·θ_i}`, `θ_i = base^(-2i/d)`, positions divided by a scaling
  factor;
- soft-capping (Gemma 2): `c·tanh(logit / c)`;
- ALiBi (Press et al.): `-m_h·|p - j|`, `m_h` the geometric sequence that
  starts at `2^(-8/N)` with that ratio, and for `N` not a power of two the
  sequence of the power of two below, then every other slope of twice it;
- sinks (gpt-oss): one more logit per head in the softmax, dropped after;
- query/key norms (Qwen3, Gemma 3, OLMo 2; Llama 4 without weights): each
  head's vector, or each token's whole projection, over its root mean
  square, times a scale;
- the query temperature (Llama 4): the query at `p` times
  `1 + scale·log(1 + floor((p + 1) / floor_scale))`;
- chunked attention (Llama 4): `j // C == p // C`;
- a scale per query feature after the rotation (nGPT's `s_qk`, Dory);
- differential attention (Ye et al., DiffLlama): heads `i` and `i + N/2`
  give `RMSNorm(o_i - λ·o_{i+N/2})·(1 - λ_init)`, with
  `λ = exp(λ_q1·λ_k1) - exp(λ_q2·λ_k2) + λ_init`.
"""

import numpy as np


def layer_weights(layer):
    """The layer's projections as float64 arrays, by name."""
    weights = {}
    dense = {
        "query": layer.query_dense,
        "key": layer.key_dense,
        "value": layer.value_dense,
        "output": layer.output_dense,
    }
    if getattr(layer, "_use_gate", False):
        dense["gate"] = layer._gate_dense
    for name, sublayer in dense.items():
        if sublayer is None:  # a layer that shares another's keys, values
            continue
        weights[name] = np.asarray(sublayer.kernel.numpy(), dtype="float64")
        bias = getattr(sublayer, "bias", None)
        weights[name + "_bias"] = (
            None if bias is None else np.asarray(bias.numpy(), dtype="float64")
        )
    return weights


def _project(x, kernel, bias):
    y = np.einsum("bte,enh->btnh", x, kernel)
    return y if bias is None else y + bias


def alibi_slopes(num_heads):
    def power_of_two(n):
        start = 2.0 ** (-(2.0 ** -(np.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if np.log2(num_heads).is_integer():
        return np.array(power_of_two(num_heads))
    closest = 2 ** int(np.floor(np.log2(num_heads)))
    extra = alibi_slopes(2 * closest)[0::2][: num_heads - closest]
    return np.array(power_of_two(closest) + list(extra))


def rms_norm(x, scope, epsilon, scale=None, bias=None):
    """`x` `(B, L, heads, H)` over the root mean square of each head's `H`
    features (`scope="head"`) or of each token's `heads·H`
    (`"projection"`), times `scale` (`(H,)` or `(heads·H,)`) if given.
    With a `bias`, a LayerNorm: `x` less its mean first, plus `bias`."""
    batch, length, heads, head = x.shape
    flat = x if scope == "head" else x.reshape(batch, length, 1, heads * head)
    if bias is not None:
        flat = flat - flat.mean(-1, keepdims=True)
    out = flat / np.sqrt((flat**2).mean(-1, keepdims=True) + epsilon)
    if scale is not None:
        out = out * np.asarray(scale, "float64")
    if bias is not None:
        out = out + np.asarray(bias, "float64")
    return out.reshape(x.shape)


def rotate(x, positions, max_wavelength=10000.0, scaling_factor=1.0,
           rotary_dim=None, inv_freq=None, attention_factor=1.0,
           interleaved=False):
    """RoPE of `x` `(B, L, heads, H)` at `positions` `(L,)`, complex form.

    Pairs `(x_i, x_{i+d/2})`, or `(x_{2i}, x_{2i+1})` when `interleaved`,
    turn by `positions · inv_freq` (by default `max_wavelength ** (-2i/d)
    / scaling_factor`) and are scaled by `attention_factor`.
    """
    d = x.shape[-1] if rotary_dim is None else rotary_dim
    half = d // 2
    if inv_freq is None:
        inv_freq = max_wavelength ** (-2.0 * np.arange(half) / d)
        inv_freq = inv_freq / scaling_factor
    angle = np.asarray(positions, "float64")[:, None] * np.asarray(inv_freq)
    if interleaved:
        first, second = x[..., 0:d:2], x[..., 1:d:2]
    else:
        first, second = x[..., :half], x[..., half:d]
    z = (first + 1j * second) * np.exp(1j * angle)[None, :, None, :]
    z = z * attention_factor
    if interleaved:
        turned = np.stack([z.real, z.imag], axis=-1).reshape(
            z.shape[:-1] + (d,)
        )
    else:
        turned = np.concatenate([z.real, z.imag], axis=-1)
    return np.concatenate([turned, x[..., d:]], axis=-1)


def reference_attention(
    weights,
    query,
    value,
    key=None,
    query_mask=None,
    value_mask=None,
    key_mask=None,
    attention_mask=None,
    use_causal_mask=False,
    sliding_window=None,
    query_offset=0,
    scale=None,
    soft_cap=None,
    attention_bias=None,
    alibi=False,
    sinks=None,
    segment_ids=None,
    key_segment_ids=None,
    rotary=None,
    qk_norm=None,
    query_temperature=None,
    chunk_size=None,
    qk_norm_after_rope=False,
    value_norm=None,
    qkv_clip=None,
    gate_activation="sigmoid",
    input_norm=None,
    output_norm=None,
    differential=None,
    query_factors=None,
):
    """Returns `(output, weights)` for rank-3 inputs, in float64.

    `attention_mask` is given already broadcastable to `(B, N, T, S)` (or
    `(B, T, S)` / `(T, S)`, which are expanded here). Query `t` sits at
    position `query_offset + t`. `sliding_window` is `w` (`|p - j| < w`) or
    `(left, right)` (`p - left <= j <= p + right`); `rotary` is `None` or
    the keyword arguments of `rotate`; `qk_norm` `None` or `(scope,
    epsilon, query_scale, key_scale)` (scales `None` without weights);
    `query_temperature` `None`, `(floor_scale, scale)` or `("power",
    length, exponent)`; `chunk_size`
    `None` or `C`; `qk_norm_after_rope` puts the norms after the rotation.
    `qk_norm` may end with `(query_bias, key_bias)`: LayerNorms.
    `value_norm` is `None` or the epsilon of the values' weightless RMS
    norm per head; `qkv_clip` `None` or `c`, the projections clipped to
    `[-c, c]`; `gate_activation` the output gate's, `"sigmoid"` or
    `"softplus"`. `input_norm` is `None` or `(epsilon, scale, bias,
    memory_too)`: the query's features normalized (RMS, or a LayerNorm
    with a `bias`), and the value's and key's with `memory_too`;
    `output_norm` `None` or `(epsilon, scale, bias)`, each token's heads
    normalized together after the gate. `differential` is `None` or
    `(lambda_init, epsilon, (λ_q1, λ_k1, λ_q2, λ_k2))`: the heads' pairs.
    `query_factors` is `None` or `(N, H)`: each query feature's factor
    after the rotation and the temperature (`use_query_scale`).
    """
    f64 = lambda x: None if x is None else np.asarray(x, dtype="float64")
    query, value = f64(query), f64(value)
    key = value if key is None else f64(key)
    if input_norm is not None:
        *norm, memory_too = input_norm
        features = lambda x: rms_norm(x[:, :, None, :], "head", *norm)[:, :, 0]
        query = features(query)
        if memory_too:
            value, key = features(value), features(key)
    q = _project(query, weights["query"], weights["query_bias"])
    k = _project(key, weights["key"], weights["key_bias"])
    v = _project(value, weights["value"], weights["value_bias"])
    if qkv_clip is not None:
        q, k, v = (np.clip(x, -qkv_clip, qkv_clip) for x in (q, k, v))
    if value_norm is not None:
        v = rms_norm(v, "head", value_norm)
    if qk_norm is not None:
        scope, epsilon, query_scale, key_scale, *biases = qk_norm
        query_bias, key_bias = biases or (None, None)
    if qk_norm is not None and not qk_norm_after_rope:
        q = rms_norm(q, scope, epsilon, query_scale, query_bias)
        k = rms_norm(k, scope, epsilon, key_scale, key_bias)
    batch, t_len, num_heads, head = q.shape
    s_len, num_kv = k.shape[1], k.shape[2]
    if rotary is not None:
        q = rotate(q, query_offset + np.arange(t_len), **rotary)
        k = rotate(k, np.arange(s_len), **rotary)
    if qk_norm is not None and qk_norm_after_rope:
        q = rms_norm(q, scope, epsilon, query_scale, query_bias)
        k = rms_norm(k, scope, epsilon, key_scale, key_bias)
    k = np.repeat(k, num_heads // num_kv, axis=2)  # head n reads n // G
    v = np.repeat(v, num_heads // num_kv, axis=2)
    if query_temperature is not None:
        p = query_offset + np.arange(t_len)
        if query_temperature[0] == "power":
            _, length, exponent = query_temperature
            growth = (1.0 + (p + 1) / length) ** exponent
        else:
            floor_scale, factor = query_temperature
            growth = 1.0 + factor * np.log(1.0 + np.floor((p + 1)
                                                          / floor_scale))
        q = q * growth[None, :, None, None]
    if query_factors is not None:
        q = q * np.asarray(query_factors, "float64")

    allowed = np.ones((batch, num_heads, t_len, s_len), dtype=bool)
    pos = query_offset + np.arange(t_len)[:, None]
    col = np.arange(s_len)[None, :]
    if use_causal_mask:
        allowed &= col <= pos
    if chunk_size is not None:
        allowed &= col // chunk_size == pos // chunk_size
    if isinstance(sliding_window, (tuple, list)):
        left, right = sliding_window
        allowed &= (col >= pos - left) & (col <= pos + right)
    elif sliding_window is not None:
        allowed &= np.abs(pos - col) < sliding_window
    if segment_ids is not None:
        ids = np.asarray(segment_ids)
        key_ids = ids if key_segment_ids is None else np.asarray(key_segment_ids)
        allowed &= ids[:, None, :, None] == key_ids[:, None, None, :]
    if query_mask is not None:
        allowed &= np.asarray(query_mask, bool)[:, None, :, None]
    for m in (value_mask, key_mask):
        if m is not None:
            allowed &= np.asarray(m, bool)[:, None, None, :]
    if attention_mask is not None:
        m = np.asarray(attention_mask, bool)
        if m.ndim == 2:
            m = m[None, None]
        elif m.ndim == 3:
            m = m[:, None]
        allowed &= m

    scale = 1.0 / np.sqrt(head) if scale is None else scale
    scores = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * np.tanh(scores / soft_cap)
    if attention_bias is not None:
        scores = scores + np.asarray(attention_bias, "float64")
    if alibi:  # `True`, or a factor of the slopes (ALiBi before the scale)
        scores = scores - float(alibi) * alibi_slopes(num_heads)[
            :, None, None] * np.abs(
            pos - col
        )
    probs = np.zeros_like(scores)
    for index in np.ndindex(batch, num_heads, t_len):
        row = allowed[index]
        logits = list(scores[index][row])
        if sinks is not None:
            logits.append(float(np.asarray(sinks)[index[1]]))
        if logits:
            logits = np.array(logits)
            e = np.exp(logits - logits.max())
            probs[index][row] = (e / e.sum())[: row.sum()]
    context = np.einsum("bnts,bsnv->btnv", probs, v)
    if "gate" in weights:
        gate = _project(query, weights["gate"], weights["gate_bias"])
        context = context * (np.logaddexp(0.0, gate)
                             if gate_activation == "softplus"
                             else 1.0 / (1.0 + np.exp(-gate)))
    if output_norm is not None:
        context = rms_norm(context, "projection", *output_norm)
    if differential is not None:
        lambda_init, epsilon, (q1, k1, q2, k2) = differential
        factor = np.exp(q1 @ k1) - np.exp(q2 @ k2) + lambda_init
        half = num_heads // 2
        context = context[:, :, :half] - factor * context[:, :, half:]
        context = rms_norm(context, "head", epsilon) * (1.0 - lambda_init)
    out = np.tensordot(context, weights["output"], axes=([2, 3], [0, 1]))
    if weights["output_bias"] is not None:
        out = out + weights["output_bias"]
    return out, probs
