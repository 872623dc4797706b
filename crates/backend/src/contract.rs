//! The shape contract of every [`Backend`] op, stated once.
//!
//! Each backend checks its arguments' kinds (which it stores its own way), then calls the
//! op's function here with their lengths, before any work: the CPU reference and CUDA thus
//! accept the same calls and reject the others with the same [`Error::Shape`]. Arguments
//! come in the trait's order, a length in place of each buffer.

#[cfg(doc)]
use crate::Backend;
use crate::{AdamW, AttnShape, Error, LmHead, Matmul, Result, Segment};

/// Index values (ids, slots, positions) as the backend holds them.
#[derive(Clone, Copy, Debug)]
pub enum Ids<'a> {
    /// On the host: their count and their range are checked.
    Host(&'a [u32]),
    /// Only on the device, this many: only the count is checked, since reading the values
    /// back would stall the stream (the kernels trust them).
    Device(usize),
}

impl Ids<'_> {
    fn len(self) -> usize {
        match self {
            Ids::Host(ids) => ids.len(),
            Ids::Device(len) => len,
        }
    }
}

/// The lengths of a [`crate::PagedLayout`].
#[derive(Clone, Copy, Debug)]
pub struct PagedLens<'a> {
    /// Entries of `block_tables`.
    pub block_tables: usize,
    /// Columns of `block_tables`.
    pub max_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Entries of `token_seq`.
    pub token_seq: usize,
    /// Position of each query token.
    pub token_pos: Ids<'a>,
    /// Every position must be below this.
    pub max_context: usize,
    /// [`crate::PagedLayout::runs`].
    pub runs: &'a [crate::QueryRun],
    /// [`crate::PagedLayout::shared`].
    pub shared: &'a [crate::SharedKeys],
}

fn shape_error(op: &'static str, msg: String) -> Error {
    Error::Shape { op, msg }
}

fn len(op: &'static str, arg: &str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        return Ok(());
    }
    Err(shape_error(
        op,
        format!("`{arg}` has {got} elements, expected {expected}"),
    ))
}

fn lens(op: &'static str, args: &[(&str, usize)], expected: usize) -> Result<()> {
    args.iter()
        .try_for_each(|&(arg, got)| len(op, arg, got, expected))
}

/// Checks each id the host holds is below `bound`, the rows of what they index.
fn in_range(op: &'static str, arg: &str, ids: Ids<'_>, bound: usize) -> Result<()> {
    let Ids::Host(ids) = ids else {
        return Ok(());
    };
    match ids.iter().position(|&i| i as usize >= bound) {
        None => Ok(()),
        Some(at) => Err(shape_error(
            op,
            format!("`{arg}[{at}]` = {} is out of range 0..{bound}", ids[at]),
        )),
    }
}

/// Checks `got` elements are whole units of `unit` (described by `what`); returns how many.
fn whole(op: &'static str, arg: &str, got: usize, unit: usize, what: String) -> Result<usize> {
    if unit == 0 || got % unit != 0 {
        return Err(shape_error(
            op,
            format!("`{arg}` of {got} elements is not whole {what}"),
        ));
    }
    Ok(got / unit)
}

/// `dense[i, :]` paired with `table[ids[i], :]`, rows of `dim`: `gather_rows`,
/// `embedding_forward` and `embedding_backward`, each with its names.
fn table_rows(
    op: &'static str,
    (dense_arg, dense): (&str, usize),
    (table_arg, table): (&str, usize),
    (ids_arg, ids): (&str, Ids<'_>),
    dim: usize,
) -> Result<()> {
    len(op, dense_arg, dense, ids.len() * dim)?;
    let rows = whole(op, table_arg, table, dim, format!("rows of {dim}"))?;
    in_range(op, ids_arg, ids, rows)
}

fn attn_shape(op: &'static str, shape: &AttnShape) -> Result<()> {
    if shape.kv_heads == 0 || shape.head_dim == 0 || shape.q_heads % shape.kv_heads != 0 {
        return Err(shape_error(
            op,
            format!(
                "q_heads {} must be a positive multiple of kv_heads {} and head_dim {} positive",
                shape.q_heads, shape.kv_heads, shape.head_dim
            ),
        ));
    }
    Ok(())
}

/// Checks each segment and its prefix lie within `tokens` and apart, and that no two
/// segments share a token.
fn packed_segments(op: &'static str, segments: &[Segment], tokens: usize) -> Result<()> {
    let span = |start: u32, len: u32| (start as usize, start as usize + len as usize);
    for (i, s) in segments.iter().enumerate() {
        let (start, end) = span(s.start, s.len);
        if end > tokens {
            return Err(shape_error(
                op,
                format!("segment {i} covers tokens {start}..{end} of {tokens}"),
            ));
        }
        if s.prefix_len == 0 {
            continue;
        }
        let (p_start, p_end) = span(s.prefix_start, s.prefix_len);
        if p_end > tokens {
            return Err(shape_error(
                op,
                format!("segment {i} has prefix {p_start}..{p_end} past {tokens} tokens"),
            ));
        }
        if p_start < end && start < p_end {
            return Err(shape_error(
                op,
                format!("segment {i} ({s:?}) overlaps its own prefix"),
            ));
        }
    }
    let mut by_start: Vec<usize> = (0..segments.len())
        .filter(|&i| segments[i].len > 0)
        .collect();
    by_start.sort_by_key(|&i| segments[i].start);
    for pair in by_start.windows(2) {
        let (a, b) = (&segments[pair[0]], &segments[pair[1]]);
        if (b.start as usize) < span(a.start, a.len).1 {
            let (first, second) = (pair[0].min(pair[1]), pair[0].max(pair[1]));
            return Err(shape_error(
                op,
                format!("segments {first} and {second} overlap"),
            ));
        }
    }
    Ok(())
}

fn lm_head_spec(op: &'static str, spec: &LmHead) -> Result<()> {
    if spec.chunk_rows == 0 || spec.vocab == 0 {
        return Err(shape_error(
            op,
            format!(
                "chunk_rows ({}) and vocab ({}) must be positive",
                spec.chunk_rows, spec.vocab
            ),
        ));
    }
    Ok(())
}

/// [`Backend::copy`].
pub fn copy(dst: usize, src: usize) -> Result<()> {
    len("copy", "src", src, dst)
}

/// [`Backend::copy_range`]: `len` elements from `src[src_offset..]` to
/// `dst[dst_offset..]`, both ranges inside their buffers.
pub fn copy_range(
    dst: usize,
    dst_offset: usize,
    src: usize,
    src_offset: usize,
    len: usize,
) -> Result<()> {
    let fits = |offset: usize, buf: usize| offset.checked_add(len).is_some_and(|end| end <= buf);
    let overrun = |what: &str, offset: usize, buf: usize| {
        Err(shape_error(
            "copy_range",
            format!("{len} elements at offset {offset} overrun `{what}` of {buf}"),
        ))
    };
    if !fits(dst_offset, dst) {
        return overrun("dst", dst_offset, dst);
    }
    if !fits(src_offset, src) {
        return overrun("src", src_offset, src);
    }
    Ok(())
}

/// [`Backend::add_assign`].
pub fn add_assign(y: usize, x: usize) -> Result<()> {
    len("add_assign", "x", x, y)
}

/// [`Backend::gather_rows`].
pub fn gather_rows(out: usize, x: usize, rows: Ids<'_>, dim: usize) -> Result<()> {
    table_rows("gather_rows", ("out", out), ("x", x), ("rows", rows), dim)
}

/// [`Backend::matmul`].
pub fn matmul(c: usize, a: usize, b: usize, dims: Matmul) -> Result<()> {
    const OP: &str = "matmul";
    len(OP, "a", a, dims.m * dims.k)?;
    len(OP, "b", b, dims.k * dims.n)?;
    len(OP, "c", c, dims.m * dims.n)
}

/// [`Backend::add_bias`].
pub fn add_bias(y: usize, bias: usize, rows: usize, cols: usize) -> Result<()> {
    len("add_bias", "bias", bias, cols)?;
    len("add_bias", "y", y, rows * cols)
}

/// [`Backend::add_bias_backward`].
pub fn add_bias_backward(dbias: usize, dy: usize, rows: usize, cols: usize) -> Result<()> {
    len("add_bias_backward", "dbias", dbias, cols)?;
    len("add_bias_backward", "dy", dy, rows * cols)
}

/// [`Backend::embedding_forward`].
pub fn embedding_forward(out: usize, table: usize, ids: Ids<'_>, dim: usize) -> Result<()> {
    let (out, table, ids) = (("out", out), ("table", table), ("ids", ids));
    table_rows("embedding_forward", out, table, ids, dim)
}

/// [`Backend::embedding_backward`].
pub fn embedding_backward(dtable: usize, dout: usize, ids: Ids<'_>, dim: usize) -> Result<()> {
    let (dout, dtable, ids) = (("dout", dout), ("dtable", dtable), ("ids", ids));
    table_rows("embedding_backward", dout, dtable, ids, dim)
}

/// [`Backend::rmsnorm_forward`].
pub fn rmsnorm_forward(
    out: usize,
    rstd: usize,
    x: usize,
    w: usize,
    rows: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "rmsnorm_forward";
    lens(OP, &[("x", x), ("out", out)], rows * dim)?;
    len(OP, "w", w, dim)?;
    len(OP, "rstd", rstd, rows)
}

/// [`Backend::rmsnorm_backward`].
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dx: usize,
    dw: usize,
    dout: usize,
    x: usize,
    w: usize,
    rstd: usize,
    rows: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "rmsnorm_backward";
    lens(OP, &[("dout", dout), ("x", x), ("dx", dx)], rows * dim)?;
    lens(OP, &[("w", w), ("dw", dw)], dim)?;
    len(OP, "rstd", rstd, rows)
}

/// [`Backend::rope`].
pub fn rope(
    x: usize,
    positions: usize,
    inv_freq: usize,
    tokens: usize,
    heads: usize,
    head_dim: usize,
) -> Result<()> {
    const OP: &str = "rope";
    if head_dim % 2 != 0 {
        return Err(shape_error(OP, format!("head_dim {head_dim} must be even")));
    }
    len(OP, "positions", positions, tokens)?;
    len(OP, "inv_freq", inv_freq, head_dim / 2)?;
    len(OP, "x", x, tokens * heads * head_dim)
}

/// [`Backend::qk_norm_rope`], one side (q or k) at a time: the lengths of
/// [`rmsnorm_forward`] over `tokens × heads` rows and of [`rope`].
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_side(
    out: usize,
    rstd: usize,
    raw: usize,
    norm: usize,
    positions: usize,
    inv_freq: usize,
    tokens: usize,
    heads: usize,
    head_dim: usize,
) -> Result<()> {
    rmsnorm_forward(out, rstd, raw, norm, tokens * heads, head_dim)?;
    rope(out, positions, inv_freq, tokens, heads, head_dim)
}

/// Packed attention: `q_like` buffers are `[T, q_heads, D]`, `kv_like` ones
/// `[T, kv_heads, D]`.
fn packed_attention(
    op: &'static str,
    q_like: &[(&str, usize)],
    kv_like: &[(&str, usize)],
    lse: usize,
    segments: &[Segment],
    shape: AttnShape,
) -> Result<()> {
    attn_shape(op, &shape)?;
    let AttnShape {
        tokens,
        q_heads,
        kv_heads,
        head_dim,
        ..
    } = shape;
    lens(op, q_like, tokens * q_heads * head_dim)?;
    lens(op, kv_like, tokens * kv_heads * head_dim)?;
    len(op, "lse", lse, tokens * q_heads)?;
    packed_segments(op, segments, tokens)
}

/// [`Backend::attention_forward`].
pub fn attention_forward(
    out: usize,
    lse: usize,
    q: usize,
    k: usize,
    v: usize,
    segments: &[Segment],
    shape: AttnShape,
) -> Result<()> {
    let (q_like, kv_like) = ([("q", q), ("out", out)], [("k", k), ("v", v)]);
    packed_attention("attention_forward", &q_like, &kv_like, lse, segments, shape)
}

/// [`Backend::attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dq: usize,
    dk: usize,
    dv: usize,
    dout: usize,
    out: usize,
    lse: usize,
    q: usize,
    k: usize,
    v: usize,
    segments: &[Segment],
    shape: AttnShape,
) -> Result<()> {
    let q_like = [("dout", dout), ("out", out), ("q", q), ("dq", dq)];
    let kv_like = [("k", k), ("v", v), ("dk", dk), ("dv", dv)];
    packed_attention(
        "attention_backward",
        &q_like,
        &kv_like,
        lse,
        segments,
        shape,
    )
}

/// [`Backend::kv_cache_write`].
pub fn kv_cache_write(
    k_cache: usize,
    v_cache: usize,
    k: usize,
    v: usize,
    slots: Ids<'_>,
    kv_heads: usize,
    head_dim: usize,
) -> Result<()> {
    const OP: &str = "kv_cache_write";
    let row = kv_heads * head_dim;
    lens(OP, &[("k", k), ("v", v)], slots.len() * row)?;
    len(OP, "v_cache", v_cache, k_cache)?;
    let cache_slots = whole(OP, "k_cache", k_cache, row, format!("slots of {row}"))?;
    in_range(OP, "slots", slots, cache_slots)
}

/// [`Backend::paged_attention`].
pub fn paged_attention(
    out: usize,
    q: usize,
    k_cache: usize,
    v_cache: usize,
    layout: PagedLens<'_>,
    shape: AttnShape,
) -> Result<()> {
    const OP: &str = "paged_attention";
    attn_shape(OP, &shape)?;
    let AttnShape {
        tokens,
        q_heads,
        kv_heads,
        head_dim,
        ..
    } = shape;
    lens(OP, &[("q", q), ("out", out)], tokens * q_heads * head_dim)?;
    let token_lens = [
        ("token_seq", layout.token_seq),
        ("token_pos", layout.token_pos.len()),
    ];
    lens(OP, &token_lens, tokens)?;
    len(OP, "v_cache", v_cache, k_cache)?;
    let block_size = layout.block_size;
    whole(
        OP,
        "k_cache",
        k_cache,
        block_size * kv_heads * head_dim,
        format!("blocks of {block_size} slots × {kv_heads} heads × {head_dim}"),
    )?;
    let max_blocks = layout.max_blocks;
    whole(
        OP,
        "block_tables",
        layout.block_tables,
        max_blocks,
        format!("rows of max_blocks {max_blocks}"),
    )?;
    in_range(OP, "token_pos", layout.token_pos, layout.max_context)?;
    query_runs(OP, layout.runs, layout.token_pos)?;
    shared_keys(OP, layout.shared, layout.runs, layout.token_pos)
}

/// Groups in token order, disjoint, non-empty, inside the call's tokens and outside every
/// run; on the host, no shared key at or after a member's position.
fn shared_keys(
    op: &'static str,
    shared: &[crate::SharedKeys],
    runs: &[crate::QueryRun],
    token_pos: Ids<'_>,
) -> Result<()> {
    let tokens = token_pos.len();
    let mut next_free = 0usize;
    for (i, group) in shared.iter().enumerate() {
        let (first, len) = (group.first as usize, group.len as usize);
        let in_run = runs.iter().find(|r| {
            let (a, b) = (r.first as usize, (r.first + r.len) as usize);
            a < first + len && first < b
        });
        if len == 0 || first < next_free || first + len > tokens || in_run.is_some() {
            return Err(shape_error(
                op,
                format!(
                    "`shared[{i}]` (tokens {first}..{}) is empty, overlaps the group before \
                     it or a run, or passes the {tokens} tokens",
                    first + len
                ),
            ));
        }
        if let Ids::Host(pos) = token_pos {
            if let Some(t) = (first..first + len).find(|&t| pos[t] < group.keys) {
                return Err(shape_error(
                    op,
                    format!(
                        "`shared[{i}]` shares {} keys but token {t} sits at position {}: \
                         a token's own position is never shared",
                        group.keys, pos[t]
                    ),
                ));
            }
        }
        next_free = first + len;
    }
    Ok(())
}

/// Runs in token order, disjoint, non-empty and inside the call's tokens; on the host,
/// their positions consecutive.
fn query_runs(op: &'static str, runs: &[crate::QueryRun], token_pos: Ids<'_>) -> Result<()> {
    let tokens = token_pos.len();
    let mut next_free = 0usize;
    for (i, run) in runs.iter().enumerate() {
        let (first, len) = (run.first as usize, run.len as usize);
        if len == 0 || first < next_free || first + len > tokens {
            return Err(shape_error(
                op,
                format!(
                    "`runs[{i}]` (tokens {first}..{}) is empty, overlaps the run before it or \
                     passes the {tokens} tokens",
                    first + len
                ),
            ));
        }
        if let Ids::Host(pos) = token_pos {
            if let Some(at) = (first + 1..first + len).find(|&t| pos[t] != pos[t - 1] + 1) {
                return Err(shape_error(
                    op,
                    format!(
                        "`runs[{i}]` covers token {at} at position {} after position {}: \
                         a run's positions must be consecutive",
                        pos[at],
                        pos[at - 1]
                    ),
                ));
            }
        }
        next_free = first + len;
    }
    Ok(())
}

/// [`Backend::swiglu_forward`].
pub fn swiglu_forward(out: usize, gate: usize, up: usize) -> Result<()> {
    lens("swiglu_forward", &[("up", up), ("out", out)], gate)
}

/// [`Backend::swiglu_backward`].
pub fn swiglu_backward(
    dgate: usize,
    dup: usize,
    dout: usize,
    gate: usize,
    up: usize,
) -> Result<()> {
    let args = [("dout", dout), ("up", up), ("dgate", dgate), ("dup", dup)];
    lens("swiglu_backward", &args, gate)
}

/// [`Backend::lm_head_forward`].
pub fn lm_head_forward(
    logprobs: usize,
    entropy: usize,
    lse: usize,
    hidden: usize,
    w: usize,
    targets: Ids<'_>,
    spec: LmHead,
) -> Result<()> {
    const OP: &str = "lm_head_forward";
    lm_head_spec(OP, &spec)?;
    len(OP, "hidden", hidden, spec.tokens * spec.dim)?;
    len(OP, "w", w, spec.vocab * spec.dim)?;
    let rows = [
        ("targets", targets.len()),
        ("logprobs", logprobs),
        ("entropy", entropy),
        ("lse", lse),
    ];
    lens(OP, &rows, spec.tokens)?;
    in_range(OP, "targets", targets, spec.vocab)
}

/// [`Backend::lm_head_backward`].
#[allow(clippy::too_many_arguments)]
pub fn lm_head_backward(
    dhidden: usize,
    dw: usize,
    dlogprobs: usize,
    dentropy: usize,
    hidden: usize,
    w: usize,
    targets: Ids<'_>,
    lse: usize,
    spec: LmHead,
) -> Result<()> {
    const OP: &str = "lm_head_backward";
    lm_head_spec(OP, &spec)?;
    lens(
        OP,
        &[("hidden", hidden), ("dhidden", dhidden)],
        spec.tokens * spec.dim,
    )?;
    lens(OP, &[("w", w), ("dw", dw)], spec.vocab * spec.dim)?;
    let rows = [
        ("dlogprobs", dlogprobs),
        ("dentropy", dentropy),
        ("targets", targets.len()),
        ("lse", lse),
    ];
    lens(OP, &rows, spec.tokens)?;
    in_range(OP, "targets", targets, spec.vocab)
}

/// [`Backend::sample`].
pub fn sample(logits: usize, vocab: usize, rows: usize) -> Result<()> {
    len("sample", "logits", logits, rows * vocab)?;
    if vocab == 0 {
        return Err(shape_error("sample", "vocab must be positive".into()));
    }
    Ok(())
}

/// [`Backend::adamw`].
pub fn adamw(
    param: usize,
    grad: usize,
    m: usize,
    v: usize,
    compute: Option<usize>,
    hp: &AdamW,
) -> Result<()> {
    const OP: &str = "adamw";
    if hp.step == 0 {
        return Err(shape_error(OP, "`step` is 1-based; got 0".into()));
    }
    lens(OP, &[("grad", grad), ("m", m), ("v", v)], param)?;
    compute.map_or(Ok(()), |c| len(OP, "compute", c, param))
}

/// [`crate::Backend::adamw_host`]: the device's `param` and `grad` and the host's
/// `master`, `m`, `v` all have one length.
pub fn adamw_host(
    param: usize,
    grad: usize,
    master: usize,
    m: usize,
    v: usize,
    hp: &AdamW,
) -> Result<()> {
    const OP: &str = "adamw_host";
    if hp.step == 0 {
        return Err(shape_error(OP, "`step` is 1-based; got 0".into()));
    }
    lens(
        OP,
        &[("grad", grad), ("master", master), ("m", m), ("v", v)],
        param,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(start: u32, len: u32, prefix_start: u32, prefix_len: u32) -> Segment {
        Segment {
            start,
            len,
            prefix_start,
            prefix_len,
        }
    }

    fn message(r: Result<()>) -> String {
        r.expect_err("rejected").to_string()
    }

    #[test]
    fn segments_stay_inside_the_batch_and_apart() {
        let check = |segments: &[Segment]| packed_segments("op", segments, 10);
        // A prompt shared by two responses, and an empty segment anywhere.
        check(&[
            seg(0, 4, 0, 0),
            seg(4, 3, 0, 4),
            seg(7, 3, 0, 4),
            seg(2, 0, 0, 0),
        ])
        .unwrap();
        assert!(message(check(&[seg(6, 2, 0, 0), seg(0, 7, 0, 0)])).contains("0 and 1 overlap"));
        assert!(message(check(&[seg(2, 4, 4, 2)])).contains("own prefix"));
        assert!(message(check(&[seg(8, 3, 0, 0)])).contains("8..11 of 10"));
        assert!(message(check(&[seg(0, 2, 9, 2)])).contains("prefix 9..11"));
    }

    #[test]
    fn ids_on_the_host_are_range_checked() {
        let err = message(gather_rows(4, 6, Ids::Host(&[0, 3]), 2));
        assert_eq!(err, "gather_rows: `rows[1]` = 3 is out of range 0..3");
        gather_rows(4, 6, Ids::Device(2), 2).unwrap();
        assert!(message(embedding_forward(4, 7, Ids::Device(2), 2)).contains("`table` of 7"));
    }

    #[test]
    fn paged_caches_are_whole_blocks_and_tables_whole_rows() {
        let shape = AttnShape {
            tokens: 1,
            q_heads: 2,
            kv_heads: 1,
            head_dim: 4,
            scale: 1.0,
        };
        let layout = |block_tables, token_pos| PagedLens {
            block_tables,
            max_blocks: 3,
            block_size: 2,
            token_seq: 1,
            token_pos,
            max_context: 5,
            runs: &[],
            shared: &[],
        };
        let paged = |cache, lens| paged_attention(8, 8, cache, cache, lens, shape);
        paged(24, layout(6, Ids::Host(&[4]))).unwrap();
        assert!(message(paged(20, layout(6, Ids::Device(1)))).contains("whole blocks"));
        assert!(message(paged(24, layout(5, Ids::Device(1)))).contains("max_blocks 3"));
        assert!(message(paged(24, layout(6, Ids::Host(&[5])))).contains("`token_pos[0]` = 5"));
        let run = |first, len| crate::QueryRun { first, len };
        for (runs, ok) in [
            ([run(0, 1)], true),
            ([run(0, 0)], false),
            ([run(0, 2)], false),
        ] {
            let lens = PagedLens {
                block_tables: 6,
                max_blocks: 3,
                block_size: 2,
                token_seq: 1,
                token_pos: Ids::Device(1),
                max_context: 5,
                runs: &runs,
                shared: &[],
            };
            match paged_attention(8, 8, 24, 24, lens, shape) {
                Ok(()) => assert!(ok),
                Err(e) => assert!(!ok && e.to_string().contains("`runs[0]` (tokens"), "{e}"),
            }
        }
    }

    #[test]
    fn shared_keys_are_disjoint_groups_outside_runs_before_their_positions() {
        let shape = AttnShape {
            tokens: 4,
            q_heads: 2,
            kv_heads: 1,
            head_dim: 4,
            scale: 1.0,
        };
        let group = |first, len, keys| crate::SharedKeys { first, len, keys };
        let runs = [crate::QueryRun { first: 3, len: 1 }];
        let pos = [4u32, 4, 3, 2];
        let check = |shared: &[crate::SharedKeys]| {
            let lens = PagedLens {
                block_tables: 12,
                max_blocks: 3,
                block_size: 2,
                token_seq: 4,
                token_pos: Ids::Host(&pos),
                max_context: 5,
                runs: &runs,
                shared,
            };
            paged_attention(32, 32, 24, 24, lens, shape)
        };
        check(&[group(0, 3, 2)]).unwrap();
        check(&[group(0, 1, 4), group(1, 2, 2)]).unwrap();
        for bad in [
            vec![group(0, 0, 2)],
            vec![group(0, 2, 2), group(1, 1, 2)],
            vec![group(2, 2, 2)],
            vec![group(3, 2, 2)],
        ] {
            assert!(message(check(&bad)).contains("`shared["), "{bad:?}");
        }
        let err = message(check(&[group(0, 3, 4)]));
        assert!(err.contains("token 2 sits at position 3"), "{err}");
    }

    #[test]
    fn lm_head_needs_positive_chunks_and_vocab() {
        let spec = |chunk_rows, vocab| LmHead {
            tokens: 0,
            dim: 2,
            vocab,
            logit_scale: 1.0,
            chunk_rows,
        };
        let forward = |spec| lm_head_forward(0, 0, 0, 0, 2 * 3, Ids::Device(0), spec);
        forward(spec(1, 3)).unwrap();
        assert!(message(forward(spec(0, 3))).contains("chunk_rows (0)"));
        let no_vocab = lm_head_forward(0, 0, 0, 0, 0, Ids::Device(0), spec(1, 0));
        assert!(message(no_vocab).contains("vocab (0)"));
    }

    #[test]
    fn copy_range_rejects_overruns_without_overflowing() {
        copy_range(4, 1, 5, 2, 3).unwrap();
        copy_range(4, 4, 0, 0, 0).unwrap();
        assert!(message(copy_range(4, 2, 5, 0, 3)).contains("overrun `dst`"));
        assert!(message(copy_range(4, 0, 5, 3, 3)).contains("overrun `src`"));
        assert!(message(copy_range(4, usize::MAX, 5, 0, 1)).contains("overrun `dst`"));
        assert!(message(copy_range(4, 0, 5, usize::MAX, 1)).contains("overrun `src`"));
    }
}
