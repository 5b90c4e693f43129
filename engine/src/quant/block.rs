//! The block layouts of the weight formats and of the quantized
//! activations: what every kernel and codec of the crate reads and writes.

use half::f16;

/// Values per quantization block of the 32-value formats (and of the
/// activation blocks they take).
pub const BLOCK: usize = 32;

/// How a weight matrix is stored (named as GGUF names them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum WeightFormat {
    F32,
    F16,
    /// 18 bytes a block: f16 scale, 32 4-bit values offset by 8.
    Q4_0,
    /// 20 bytes a block: f16 scale, f16 minimum, 32 4-bit values.
    Q4_1,
    /// 22 bytes a block: f16 scale, 32 high bits, 32 4-bit values; offset 16.
    Q5_0,
    /// 24 bytes a block: f16 scale, f16 minimum, 32 high bits, 32 4-bit values.
    Q5_1,
    /// 34 bytes a block: f16 scale, 32 signed 8-bit values.
    Q8_0,
    /// 144 bytes a super-block of 256: f16 scale and minimum scale, 8 6-bit
    /// scales and minimums, 256 4-bit values.
    Q4_K,
    /// 176 bytes a super-block: as `Q4_K` plus a fifth bit per value.
    Q5_K,
    /// 210 bytes a super-block: 256 6-bit values offset by 32, 16 i8 scales,
    /// an f16 scale.
    Q6_K,
    /// 84 bytes a super-block: 16 4-bit scales and 4-bit minimums, 256
    /// 2-bit values, f16 scale and minimum scale.
    Q2_K,
    /// 110 bytes a super-block: 256 high bits, 256 2-bit values (3-bit
    /// values offset by 4), 16 6-bit scales offset by 32, an f16 scale.
    Q3_K,
}

impl WeightFormat {
    /// Values per block (per super-block for the K-quants).
    pub fn block_values(self) -> usize {
        match self {
            Self::F32 | Self::F16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => BLOCK,
            Self::Q4_K | Self::Q5_K | Self::Q6_K | Self::Q2_K | Self::Q3_K => QK_K,
        }
    }

    /// Bytes one block takes.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4_K => 144,
            Self::Q5_K => 176,
            Self::Q6_K => 210,
            Self::Q2_K => 84,
            Self::Q3_K => 110,
        }
    }

    /// Bytes one row of `cols` values takes.
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_values() * self.block_bytes()
    }

    pub(super) fn is_quantized(self) -> bool {
        self.block_values() > 1
    }

    /// The activation format this weight format's dot product takes.
    pub(super) fn activation_kind(self) -> ActivationKind {
        match self {
            Self::Q4_1 | Self::Q5_1 => ActivationKind::Q8_1,
            Self::Q4_0 | Self::Q5_0 | Self::Q8_0 => ActivationKind::Q8_0,
            Self::Q4_K | Self::Q5_K | Self::Q6_K | Self::Q2_K | Self::Q3_K => ActivationKind::Q8K,
            Self::F32 | Self::F16 => ActivationKind::F32,
        }
    }
}

/// The activation formats that dot products take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ActivationKind {
    F32,
    Q8_0,
    Q8_1,
    /// 256-value blocks with an f32 scale and sums by 16 (the K-quants).
    Q8K,
}

/// One block of 32 activations rounded to i8. `d` is already rounded through
/// f16 as llama.cpp stores it; `s` is `d * sum(qs)` (also f16-rounded), used
/// by Q4_1's minimum term. The values come first and the block is aligned
/// to 32 bytes, so the kernels' 32-byte loads never split a cache line.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(32))]
pub struct BlockQ8 {
    pub qs: [i8; BLOCK],
    pub d: f32,
    pub s: f32,
}

/// Rounds an f32 through f16, as llama.cpp does when it stores a scale.
#[inline]
pub(crate) fn round_f16(value: f32) -> f32 {
    f16::from_f32(value).to_f32()
}

#[inline]
pub(super) fn read_f16(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// The 32 unsigned 5-bit values of a Q5 block whose high bits start at
/// byte `at` (the nibbles follow them): element `j` takes bit `j`.
pub(super) fn q5_values(block: &[u8], at: usize) -> [u8; BLOCK] {
    let high = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
    let nibbles = &block[at + 4..at + 20];
    std::array::from_fn(|j| {
        let nibble = if j < 16 {
            nibbles[j] & 0x0F
        } else {
            nibbles[j - 16] >> 4
        };
        nibble | ((((high >> j) & 1) as u8) << 4)
    })
}

/// Packs 32 5-bit values into a Q5 block's high bits and nibbles.
pub(super) fn pack_q5(values: &[u8; BLOCK], out: &mut Vec<u8>) {
    let high = (0..BLOCK).fold(0u32, |h, j| h | (((values[j] >> 4) as u32 & 1) << j));
    out.extend(high.to_le_bytes());
    out.extend((0..16).map(|j| (values[j] & 0x0F) | ((values[j + 16] & 0x0F) << 4)));
}

/// Values per super-block.
pub const QK_K: usize = 256;

/// One super-block of 256 activations rounded to i8 (llama.cpp's
/// `block_q8_K`): the scale is kept in f32, and `bsums[j]` is the sum of
/// values `16j..16j+16`.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(4))]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}
