// What every matrix-product kernel shares (`matvec.wgsl` and
// `matvec_k.wgsl` are each compiled after this file). A workgroup of 64
// threads computes 8 rows of W for TOKENS product rows (set before this
// file: 1 for a vector's product, 8 for a tile of tokens), 8 threads
// (lanes) a row of W. A lane reads its share of a block of W once and
// multiplies it with each of the tile's rows of x, so a prompt or a batch
// reads W once per tile, not once per token; each product row's sum is
// the single token's, in the same order, so both compilations give the
// same bits. The row's lanes then add their partial sums (`finish`, in
// workgroup memory or across a subgroup: `finish_*.wgsl`). Product row z
// reads its row of x and writes y[z] (rows values). W is read as GGUF
// stores it, so blocks of any byte size are read out of u32 words
// (`word_at`).
//
// A routed product (a mixture of experts) has W as every expert's matrix
// one after another, and a product row z per (token, chosen expert): it
// reads x's row z / x_per and expert `routes[2z]`'s matrix (`x_row`,
// `w_row`). A plain product has x_per 0.

struct Params {
    rows: u32,
    cols: u32,
    x_per: u32,
    // Product rows in all.
    products: u32,
    _rest: array<vec4<u32>, 3>,
}

@group(0) @binding(0) var<uniform> shape: Params;
@group(0) @binding(1) var<storage, read> weights: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
// The 8-bit blocks of x (10 words each), for the block formats.
@group(0) @binding(4) var<storage, read> xq: array<u32>;
// Where `quantize_q8` writes them.
@group(0) @binding(5) var<storage, read_write> y_q: array<u32>;
// A routed product's routes: per product row, its expert and its weight's
// bits (`moe.wgsl: route`); one unused word for a plain product.
@group(0) @binding(6) var<storage, read> routes: array<u32>;

const THREADS: u32 = 64u;
const ROWS: u32 = 8u;
const LANES: u32 = 8u;
const Q8_WORDS: u32 = 10u;

fn byte_at(offset: u32) -> u32 {
    return (weights[offset >> 2u] >> ((offset & 3u) * 8u)) & 0xffu;
}

fn f16_at(offset: u32) -> f32 {
    return unpack2x16float(byte_at(offset) | (byte_at(offset + 1u) << 8u)).x;
}

fn xq_scale(block: u32) -> f32 {
    return bitcast<f32>(xq[block + 8u]);
}

fn xq_sum(block: u32) -> f32 {
    return bitcast<f32>(xq[block + 9u]);
}

// The row of x product row z reads.
fn x_row(z: u32) -> u32 {
    if (shape.x_per == 0u) {
        return z;
    }
    return z / shape.x_per;
}

// The row of W's buffer that row `row` of product row z reads.
fn w_row(z: u32, row: u32) -> u32 {
    if (shape.x_per == 0u) {
        return row;
    }
    return routes[2u * z] * shape.rows + row;
}

// The workgroup's first product row.
fn first_of(group: vec3<u32>) -> u32 {
    return group.z * TOKENS;
}

// Whether the tile starting at `first` has a t-th product row (uniform
// across the workgroup, so `finish`'s barriers may follow it).
fn has(first: u32, t: u32) -> bool {
    return first + t < shape.products;
}

// Writes each of the tile's product rows (`finish`).
fn finish_tile(row: u32, first: u32, thread: u32, sums: array<f32, TOKENS>) {
    for (var t = 0u; t < TOKENS; t = t + 1u) {
        if (has(first, t)) {
            finish(row, first + t, thread, sums[t]);
        }
    }
}

// The row of W this thread works on (the grid wraps to y), and its lane.
fn row_of(group: vec3<u32>, count: vec3<u32>, thread: u32) -> u32 {
    return (group.y * count.x + group.x) * ROWS + thread / LANES;
}

// The word of W's bytes starting at byte `offset` (any alignment).
fn word_at(offset: u32) -> u32 {
    let first = offset >> 2u;
    let shift = (offset & 3u) * 8u;
    if (shift == 0u) {
        return weights[first];
    }
    return (weights[first] >> shift) | (weights[first + 1u] << (32u - shift));
}

const LOW_NIBBLES: u32 = 0x0f0f0f0fu;

