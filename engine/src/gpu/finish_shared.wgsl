// `finish` through workgroup memory: every adapter has it.

var<workgroup> partial: array<f32, 64>;

// Adds each row's lanes and writes the rows' values.
fn finish(row: u32, token: u32, thread: u32, partial_sum: f32) {
    partial[thread] = partial_sum;
    workgroupBarrier();
    let lane = thread % LANES;
    for (var half = LANES / 2u; half > 0u; half = half / 2u) {
        if (lane < half) {
            partial[thread] = partial[thread] + partial[thread + half];
        }
        workgroupBarrier();
    }
    if (lane == 0u && row < shape.rows) {
        y[token * shape.rows + row] = partial[thread];
    }
}
