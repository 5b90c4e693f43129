// `finish` across a subgroup (adapters with subgroups of 8 lanes or more:
// a row's 8 lanes are then in one), without workgroup memory or barriers.
// Lane 0 adds the same pairs in the same order as `finish_shared.wgsl`:
// ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)), so both give the
// same bits.

// Adds each row's lanes and writes the rows' values.
fn finish(row: u32, token: u32, thread: u32, partial_sum: f32) {
    var sum = partial_sum;
    sum = sum + subgroupShuffleXor(sum, 4u);
    sum = sum + subgroupShuffleXor(sum, 2u);
    sum = sum + subgroupShuffleXor(sum, 1u);
    if (thread % LANES == 0u && row < shape.rows) {
        y[token * shape.rows + row] = sum;
    }
}
