// Attention over the paged f16 KV cache, one workgroup per (query head,
// token): out = softmax(scale q.K) V over the positions the token's
// sequence has seen (its last `window` with a sliding window).
//
// The arithmetic follows the CPU's (model/attention.rs): q rounded to f16,
// scores soft-capped where the family caps them, the softmax's weights
// rounded to f16 before they meet V, e^x as the CPU computes it
// (exp_poly.wgsl). Three passes over the positions and no scratch memory:
// the first finds the largest score, the second the softmax's sum (each
// thread over its positions, then combined), the third takes 64 positions
// at a time, their weights in workgroup memory, and each thread adds them
// into its own dimensions of the output, position by position.
// A token's result depends on its sequence only, never on the batch.

struct Params {
    heads: u32,
    head_dim: u32,
    kv_dim: u32,
    // Query heads per KV head.
    group: u32,
    // 0: no window.
    window: u32,
    scale: f32,
    // 0: no soft cap.
    softcap: f32,
    // The first query head and KV head of these (a tensor rank's share):
    // query head h reads KV head (q_first + h) / group - kv_first.
    q_first: u32,
    kv_first: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    _rest: array<vec4<u32>, 1>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> keys: array<u32>;
@group(0) @binding(3) var<storage, read> values: array<u32>;
// Per token: its position, and where its sequence's block table starts in
// `tables`.
@group(0) @binding(4) var<storage, read> tokens: array<u32>;
@group(0) @binding(5) var<storage, read> tables: array<u32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

const THREADS: u32 = 64u;
const BLOCK_TOKENS: u32 = 16u;
// The largest head dimension (4 output dimensions per thread).
const MAX_HEAD_DIM: u32 = 256u;
const NONE: f32 = -3.0e38;

var<workgroup> query: array<f32, 256>;
var<workgroup> partial: array<f32, 64>;
var<workgroup> tile_weights: array<f32, 64>;
var<workgroup> tile_slots: array<u32, 64>;

fn reduce_sum(thread: u32, value: f32) -> f32 {
    partial[thread] = value;
    workgroupBarrier();
    for (var half = THREADS / 2u; half > 0u; half = half / 2u) {
        if (thread < half) {
            partial[thread] = partial[thread] + partial[thread + half];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

fn reduce_max(thread: u32, value: f32) -> f32 {
    partial[thread] = value;
    workgroupBarrier();
    for (var half = THREADS / 2u; half > 0u; half = half / 2u) {
        if (thread < half) {
            partial[thread] = max(partial[thread], partial[thread + half]);
        }
        workgroupBarrier();
    }
    let most = partial[0];
    workgroupBarrier();
    return most;
}

// The cache slot of position `position` of the sequence whose block
// table starts at `table`.
fn slot_of(table: u32, position: u32) -> u32 {
    return tables[table + position / BLOCK_TOKENS] * BLOCK_TOKENS + position % BLOCK_TOKENS;
}

// The scaled (and capped) score of the key in `slot` of KV head `kv_head`.
fn score(slot: u32, kv_head: u32) -> f32 {
    let start = (slot * p.kv_dim + kv_head * p.head_dim) / 2u;
    var dot = 0.0;
    for (var w = 0u; w < p.head_dim / 2u; w = w + 1u) {
        let key = unpack2x16float(keys[start + w]);
        dot = dot + query[2u * w] * key.x + query[2u * w + 1u] * key.y;
    }
    var s = dot * p.scale;
    if (p.softcap > 0.0) {
        s = p.softcap * tanh(s / p.softcap);
    }
    return s;
}

fn value_at(slot: u32, kv_head: u32, d: u32) -> f32 {
    let element = slot * p.kv_dim + kv_head * p.head_dim + d;
    let pair = unpack2x16float(values[element / 2u]);
    return select(pair.x, pair.y, (element & 1u) == 1u);
}

fn round_f16(x: f32) -> f32 {
    return unpack2x16float(pack2x16float(vec2<f32>(x, 0.0))).x;
}

@compute @workgroup_size(64)
fn attention(@builtin(workgroup_id) group: vec3<u32>,
             @builtin(local_invocation_index) thread: u32) {
    let head = group.x;
    let token = group.y;
    let kv_head = (p.q_first + head) / p.group - p.kv_first;
    let position = tokens[2u * token];
    let table = tokens[2u * token + 1u];
    let seen = position + 1u;
    var first = 0u;
    if (p.window > 0u && seen > p.window) {
        first = seen - p.window;
    }
    let q_from = (token * p.heads + head) * p.head_dim;
    for (var d = thread; d < p.head_dim; d = d + THREADS) {
        query[d] = round_f16(q[q_from + d]);
    }
    workgroupBarrier();

    // Pass 1: the largest score; then the sum of each e^(s - largest), as
    // the CPU's softmax takes them (the order of the sum differs).
    var most = NONE;
    for (var at = first + thread; at < seen; at = at + THREADS) {
        most = max(most, score(slot_of(table, at), kv_head));
    }
    let top = reduce_max(thread, most);
    var sum = 0.0;
    for (var at = first + thread; at < seen; at = at + THREADS) {
        sum = sum + exp_poly(score(slot_of(table, at), kv_head) - top);
    }
    let inverse = 1.0 / reduce_sum(thread, sum);

    // Pass 2: the weights, 64 positions at a time, into the output.
    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    for (var tile = first; tile < seen; tile = tile + THREADS) {
        let at = tile + thread;
        var weight = 0.0;
        var slot = 0u;
        if (at < seen) {
            slot = slot_of(table, at);
            weight = round_f16(exp_poly(score(slot, kv_head) - top) * inverse);
        }
        tile_weights[thread] = weight;
        tile_slots[thread] = slot;
        workgroupBarrier();
        let in_tile = min(THREADS, seen - tile);
        for (var j = 0u; j < in_tile; j = j + 1u) {
            let w = tile_weights[j];
            let s = tile_slots[j];
            for (var k = 0u; k < 4u; k = k + 1u) {
                let d = thread + k * THREADS;
                if (d < p.head_dim) {
                    acc[k] = acc[k] + w * value_at(s, kv_head, d);
                }
            }
        }
        workgroupBarrier();
    }
    for (var k = 0u; k < 4u; k = k + 1u) {
        let d = thread + k * THREADS;
        if (d < p.head_dim) {
            out[q_from + d] = acc[k];
        }
    }
}
