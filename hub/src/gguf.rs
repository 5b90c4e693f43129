//! GGUF files as the hub holds them: headers read from a prefix of the file
//! (so a card needs only the first megabytes, fetched with `Range`), the
//! file names of a repository (quantization labels, llama.cpp's split
//! shards `NAME-00001-of-00003.gguf`), and the join of a split model's
//! shards into the one file the engine opens.
//!
//! Only the header is parsed; tensor data is copied, never decoded.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// `GGUF`, little-endian.
const MAGIC: u32 = 0x4655_4747;
/// The alignment of tensor data when `general.alignment` does not say.
const DEFAULT_ALIGNMENT: u64 = 32;
/// A header larger than this is refused (the largest vocabularies make
/// headers of tens of megabytes).
pub const MAX_HEADER_BYTES: u64 = 256 << 20;
/// The split keys llama.cpp's `gguf-split` writes into every shard.
pub const SPLIT_NO: &str = "split.no";
pub const SPLIT_COUNT: &str = "split.count";
pub const SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// Why a header cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The bytes end inside the header: at least `at_least` are needed.
    #[error("the GGUF header goes on past byte {have} (at least {at_least} bytes needed)")]
    NeedMore { have: u64, at_least: u64 },
    #[error("not a GGUF header: {0}")]
    Invalid(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl GgufError {
    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |source| Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// A metadata value: numbers, booleans and strings decoded; arrays only
/// described (their bytes are kept raw).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    Int(i128),
    Float(f64),
    Bool(bool),
    Str(String),
    Array { elem_type: u32, len: u64 },
}

/// One metadata entry, with its value's bytes as the file has them (type
/// tag first), so a header can be written again unchanged.
#[derive(Clone, Debug, PartialEq)]
pub struct MetaEntry {
    pub key: String,
    pub value: MetaValue,
    raw: Vec<u8>,
}

impl MetaEntry {
    /// A `u16` entry (the type `gguf-split` gives `split.no` and `split.count`).
    pub fn u16(key: &str, value: u16) -> Self {
        let mut raw = 2u32.to_le_bytes().to_vec();
        raw.extend(value.to_le_bytes());
        Self {
            key: key.into(),
            value: MetaValue::Int(value.into()),
            raw,
        }
    }

    /// A `u32` entry.
    pub fn u32(key: &str, value: u32) -> Self {
        let mut raw = 4u32.to_le_bytes().to_vec();
        raw.extend(value.to_le_bytes());
        Self {
            key: key.into(),
            value: MetaValue::Int(value.into()),
            raw,
        }
    }

    /// A string entry.
    pub fn string(key: &str, value: &str) -> Self {
        let mut raw = 8u32.to_le_bytes().to_vec();
        put_string(&mut raw, value);
        Self {
            key: key.into(),
            value: MetaValue::Str(value.into()),
            raw,
        }
    }

    /// An `i32` entry (`split.tensors.count`).
    pub fn i32(key: &str, value: i32) -> Self {
        let mut raw = 5u32.to_le_bytes().to_vec();
        raw.extend(value.to_le_bytes());
        Self {
            key: key.into(),
            value: MetaValue::Int(value.into()),
            raw,
        }
    }
}

/// One tensor's entry in the header.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: the fastest-varying dimension first.
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// From the start of the tensor data.
    pub offset: u64,
}

impl TensorInfo {
    /// Bytes of data, when the type is one this module knows.
    pub fn size_bytes(&self) -> Option<u64> {
        let (block, bytes) = type_layout(self.ggml_type)?;
        let elements = self.dims.iter().try_fold(1u64, |n, d| n.checked_mul(*d))?;
        Some(elements / block * bytes)
    }
}

/// A parsed header.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    pub version: u32,
    pub metadata: Vec<MetaEntry>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Where the tensor data starts (aligned); also the header's length.
    pub data_offset: u64,
}

impl Header {
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata
            .iter()
            .find(|e| e.key == key)
            .map(|e| &e.value)
    }

    pub fn get_int(&self, key: &str) -> Option<i128> {
        match self.get(key)? {
            MetaValue::Int(v) => Some(*v),
            _ => None,
        }
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        match self.get(key)? {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// `(split.no, split.count)` of a shard; `None` for a whole file.
    pub fn split(&self) -> Option<(u64, u64)> {
        let no = u64::try_from(self.get_int(SPLIT_NO)?).ok()?;
        let count = u64::try_from(self.get_int(SPLIT_COUNT)?).ok()?;
        Some((no, count))
    }

    /// Bytes of tensor data the entries describe (the end of the last
    /// tensor), when every type is known.
    pub fn data_len(&self) -> Option<u64> {
        self.tensors.iter().try_fold(0u64, |end, t| {
            Some(end.max(t.offset.checked_add(t.size_bytes()?)?))
        })
    }

    /// The header as bytes, padded to the alignment.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(MAGIC.to_le_bytes());
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for entry in &self.metadata {
            put_string(&mut out, &entry.key);
            out.extend(&entry.raw);
        }
        for tensor in &self.tensors {
            put_string(&mut out, &tensor.name);
            out.extend((tensor.dims.len() as u32).to_le_bytes());
            for dim in &tensor.dims {
                out.extend(dim.to_le_bytes());
            }
            out.extend(tensor.ggml_type.to_le_bytes());
            out.extend(tensor.offset.to_le_bytes());
        }
        let padded = align(out.len() as u64, self.alignment) as usize;
        out.resize(padded, 0);
        out
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn align(n: u64, alignment: u64) -> u64 {
    n.div_ceil(alignment.max(1)) * alignment.max(1)
}

/// `(values per block, bytes per block)` of a ggml type.
pub fn type_layout(ggml_type: u32) -> Option<(u64, u64)> {
    Some(match ggml_type {
        0 => (1, 4),     // F32
        1 => (1, 2),     // F16
        2 => (32, 18),   // Q4_0
        3 => (32, 20),   // Q4_1
        6 => (32, 22),   // Q5_0
        7 => (32, 24),   // Q5_1
        8 => (32, 34),   // Q8_0
        9 => (32, 36),   // Q8_1
        10 => (256, 84), // Q2_K
        11 => (256, 110),
        12 => (256, 144),
        13 => (256, 176),
        14 => (256, 210),
        15 => (256, 292), // Q8_K
        24 => (1, 1),     // I8
        25 => (1, 2),
        26 => (1, 4),
        27 => (1, 8),
        28 => (1, 8), // F64
        30 => (1, 2), // BF16
        _ => return None,
    })
}

/// The name of a ggml type the engine runs (F32, F16, BF16, Q4_0, Q4_1,
/// Q5_0, Q5_1, Q8_0, Q8_1 and the K-quants); `None` for the others.
pub fn engine_type_name(ggml_type: u32) -> Option<&'static str> {
    Some(match ggml_type {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        30 => "BF16",
        _ => return None,
    })
}

/// A reader over a prefix of a file that says how much more it needs.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: u64) -> Result<&[u8], GgufError> {
        let end = (self.at as u64).saturating_add(n);
        if end > self.bytes.len() as u64 {
            return Err(GgufError::NeedMore {
                have: self.bytes.len() as u64,
                at_least: end,
            });
        }
        let slice = &self.bytes[self.at..end as usize];
        self.at = end as usize;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        self.array().map(u64::from_le_bytes)
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let len = self.u64()?;
        if len > MAX_HEADER_BYTES {
            return Err(GgufError::Invalid(format!("a string of {len} bytes")));
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| GgufError::Invalid("a string that is not UTF-8".into()))
    }

    /// One value of type `kind`, decoded where it is a scalar or a string.
    fn value(&mut self, kind: u32, depth: u32) -> Result<MetaValue, GgufError> {
        let int = |b: &[u8], signed: bool| -> i128 {
            let mut wide = [0u8; 16];
            wide[..b.len()].copy_from_slice(b);
            let negative = signed && b.last().is_some_and(|x| x & 0x80 != 0);
            if negative {
                wide[b.len()..].fill(0xff);
            }
            i128::from_le_bytes(wide)
        };
        Ok(match kind {
            0 | 1 => MetaValue::Int(int(self.take(1)?, kind == 1)),
            2 | 3 => MetaValue::Int(int(self.take(2)?, kind == 3)),
            4 | 5 => MetaValue::Int(int(self.take(4)?, kind == 5)),
            10 | 11 => MetaValue::Int(int(self.take(8)?, kind == 11)),
            6 => MetaValue::Float(f32::from_le_bytes(self.array()?).into()),
            12 => MetaValue::Float(f64::from_le_bytes(self.array()?)),
            7 => MetaValue::Bool(self.take(1)?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 if depth < 4 => {
                let elem_type = self.u32()?;
                let len = self.u64()?;
                self.skip_array(elem_type, len, depth)?;
                MetaValue::Array { elem_type, len }
            }
            other => return Err(GgufError::Invalid(format!("value type {other}"))),
        })
    }

    fn skip_array(&mut self, elem_type: u32, len: u64, depth: u32) -> Result<(), GgufError> {
        let fixed = match elem_type {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        if let Some(size) = fixed {
            let bytes = len
                .checked_mul(size)
                .ok_or_else(|| GgufError::Invalid(format!("an array of {len} values")))?;
            return self.take(bytes).map(|_| ());
        }
        // Strings (or nested arrays): at least their length fields.
        let at_least = (self.at as u64).saturating_add(len.saturating_mul(8));
        if at_least > MAX_HEADER_BYTES {
            return Err(GgufError::Invalid(format!("an array of {len} entries")));
        }
        if at_least > self.bytes.len() as u64 {
            return Err(GgufError::NeedMore {
                have: self.bytes.len() as u64,
                at_least,
            });
        }
        for _ in 0..len {
            self.value(elem_type, depth + 1)?;
        }
        Ok(())
    }
}

/// Parses the header at the start of `bytes` (a prefix of the file is
/// enough; [`GgufError::NeedMore`] says how much more is needed).
pub fn parse(bytes: &[u8]) -> Result<Header, GgufError> {
    let mut cursor = Cursor { bytes, at: 0 };
    if cursor.u32()? != MAGIC {
        return Err(GgufError::Invalid(
            "the file does not start with GGUF".into(),
        ));
    }
    let version = cursor.u32()?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::Invalid(format!(
            "version {version} (2 and 3 are read)"
        )));
    }
    let n_tensors = cursor.u64()?;
    let n_kv = cursor.u64()?;
    if n_tensors > 1 << 24 || n_kv > 1 << 24 {
        return Err(GgufError::Invalid(format!(
            "{n_tensors} tensors and {n_kv} metadata entries"
        )));
    }
    // Counts come from the file: grow as entries actually parse, so a header
    // that claims millions of entries costs nothing until they are there.
    let mut metadata = Vec::with_capacity((n_kv as usize).min(1024));
    for _ in 0..n_kv {
        let key = cursor.string()?;
        let start = cursor.at;
        let kind = cursor.u32()?;
        let value = cursor.value(kind, 0)?;
        let raw = bytes[start..cursor.at].to_vec();
        metadata.push(MetaEntry { key, value, raw });
    }
    let mut tensors = Vec::with_capacity((n_tensors as usize).min(4096));
    for _ in 0..n_tensors {
        let name = cursor.string()?;
        let n_dims = cursor.u32()?;
        if n_dims > 8 {
            return Err(GgufError::Invalid(format!("{name}: {n_dims} dimensions")));
        }
        let dims = (0..n_dims)
            .map(|_| cursor.u64())
            .collect::<Result<Vec<_>, _>>()?;
        let ggml_type = cursor.u32()?;
        let offset = cursor.u64()?;
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        });
    }
    let alignment = metadata
        .iter()
        .find(|e| e.key == "general.alignment")
        .and_then(|e| match e.value {
            MetaValue::Int(v) => u64::try_from(v).ok().filter(|a| *a > 0),
            _ => None,
        })
        .unwrap_or(DEFAULT_ALIGNMENT);
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset: align(cursor.at as u64, alignment),
    })
}

/// Reads the header of a GGUF file on disk, reading only as far as it goes.
pub fn read_header(path: &Path) -> Result<Header, GgufError> {
    let mut file = std::fs::File::open(path).map_err(GgufError::io(path))?;
    let len = file.metadata().map_err(GgufError::io(path))?.len();
    let mut bytes = Vec::new();
    let mut want = FIRST_READ.min(len);
    loop {
        let have = bytes.len() as u64;
        (&mut file)
            .take(want - have)
            .read_to_end(&mut bytes)
            .map_err(GgufError::io(path))?;
        match parse(&bytes) {
            Err(GgufError::NeedMore { at_least, .. }) => {
                want = next_read(bytes.len() as u64, at_least, len)?;
            }
            other => return other,
        }
    }
}

/// The first read of a header: a split model's later shards have headers
/// of a few kilobytes; a first shard's (the tokenizer's vocabulary is the
/// bulk) takes a few doublings.
pub const FIRST_READ: u64 = 256 << 10;

/// How far to read next after `have` bytes that need `at_least`: twice as
/// far (so a header of a few megabytes takes a handful of requests and is
/// read at most twice over), within the file and [`MAX_HEADER_BYTES`].
pub fn next_read(have: u64, at_least: u64, file_len: u64) -> Result<u64, GgufError> {
    if have >= file_len || at_least > file_len {
        return Err(GgufError::Invalid(format!(
            "the header needs {at_least} bytes; the file has {file_len}"
        )));
    }
    if have >= MAX_HEADER_BYTES {
        return Err(GgufError::Invalid(format!(
            "the header is larger than {} MB",
            MAX_HEADER_BYTES >> 20
        )));
    }
    Ok(at_least.max(have.saturating_mul(2)).min(file_len))
}

/// The parts of a `.gguf` file name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufName {
    /// The name without `.gguf` and the split suffix: what a split's shards
    /// share.
    pub stem: String,
    /// `(shard number from 1, shard count)` of a split model's file.
    pub shard: Option<(u32, u32)>,
}

/// `NAME.gguf` or `NAME-00001-of-00003.gguf`; `None` for other files.
pub fn parse_name(path: &str) -> Option<GgufName> {
    let base = path.strip_suffix(".gguf")?;
    let split = base.rsplit_once("-of-").and_then(|(head, count)| {
        let (stem, no) = head.rsplit_once('-')?;
        let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
        if !(digits(no) && digits(count)) {
            return None;
        }
        Some((stem, no.parse::<u32>().ok()?, count.parse::<u32>().ok()?))
    });
    Some(match split {
        Some((stem, no, count)) if no >= 1 && no <= count => GgufName {
            stem: stem.to_string(),
            shard: Some((no, count)),
        },
        _ => GgufName {
            stem: base.to_string(),
            shard: None,
        },
    })
}

/// The name of shard `no` (from 1) of `count` of `stem`, as `gguf-split`
/// writes it.
pub fn shard_name(stem: &str, no: u32, count: u32) -> String {
    format!("{stem}-{no:05}-of-{count:05}.gguf")
}

/// Quantization labels as llama.cpp names files, with their approximate
/// bits per weight (for "the closest" when the one asked for is missing).
/// Longer labels first, so `Q4_K_M` is not read as `Q4_K`.
pub const QUANTS: &[(&str, f32)] = &[
    ("IQ1_S", 1.6),
    ("IQ1_M", 1.75),
    ("IQ2_XXS", 2.1),
    ("IQ2_XS", 2.3),
    ("IQ2_S", 2.5),
    ("IQ2_M", 2.7),
    ("IQ3_XXS", 3.1),
    ("IQ3_XS", 3.3),
    ("IQ3_S", 3.4),
    ("IQ3_M", 3.7),
    ("IQ4_XS", 4.25),
    ("IQ4_NL", 4.5),
    ("Q2_K_S", 2.6),
    ("Q2_K_L", 3.0),
    ("Q2_K", 2.96),
    ("Q3_K_S", 3.5),
    ("Q3_K_M", 3.9),
    ("Q3_K_L", 4.3),
    ("Q3_K_XL", 4.5),
    ("Q3_K", 3.9),
    ("Q4_0_4_4", 4.5),
    ("Q4_0_4_8", 4.5),
    ("Q4_0_8_8", 4.5),
    ("Q4_K_S", 4.6),
    ("Q4_K_M", 4.85),
    ("Q4_K_L", 5.0),
    ("Q4_K", 4.85),
    ("Q4_0", 4.55),
    ("Q4_1", 5.0),
    ("Q5_K_S", 5.55),
    ("Q5_K_M", 5.7),
    ("Q5_K_L", 5.8),
    ("Q5_K", 5.7),
    ("Q5_0", 5.5),
    ("Q5_1", 6.0),
    ("Q6_K_L", 6.7),
    ("Q6_K", 6.6),
    ("Q8_0", 8.5),
    ("BF16", 16.0),
    ("FP16", 16.0),
    ("F16", 16.0),
    ("FP32", 32.0),
    ("F32", 32.0),
];

/// The quantization label in a file name (`Model.Q4_K_M.gguf` →
/// `Q4_K_M`), matched whole (between separators), in upper case.
pub fn quant_of_name(name: &str) -> Option<&'static str> {
    let upper = name.to_ascii_uppercase();
    let bytes = upper.as_bytes();
    let separated = |at: usize, len: usize| {
        let before = at == 0 || !bytes[at - 1].is_ascii_alphanumeric();
        let after = bytes
            .get(at + len)
            .is_none_or(|b| !b.is_ascii_alphanumeric() && *b != b'_');
        before && after
    };
    QUANTS.iter().map(|(label, _)| *label).find(|label| {
        upper
            .match_indices(label)
            .any(|(at, _)| separated(at, label.len()))
    })
}

/// The quantization a file's `general.file_type` names (llama.cpp's
/// `LLAMA_FTYPE_*`).
pub fn quant_of_file_type(file_type: i128) -> Option<&'static str> {
    Some(match file_type {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        32 => "BF16",
        _ => return None,
    })
}

/// Bits per weight of a label from [`QUANTS`] (any case).
pub fn bits_of(label: &str) -> Option<f32> {
    let upper = label.to_ascii_uppercase();
    QUANTS
        .iter()
        .find(|(name, _)| *name == upper)
        .map(|(_, bits)| *bits)
}

/// Among `labels`, the one nearest `wanted` in bits per weight: the same
/// label first, then the nearest, a larger one winning a tie.
pub fn closest<'a>(wanted: &str, labels: &[&'a str]) -> Option<&'a str> {
    if let Some(same) = labels.iter().find(|l| l.eq_ignore_ascii_case(wanted)) {
        return Some(same);
    }
    let target = bits_of(wanted)?;
    labels
        .iter()
        .filter_map(|l| Some((*l, bits_of(l)?)))
        .min_by(|(_, a), (_, b)| {
            let (da, db) = ((a - target).abs(), (b - target).abs());
            da.total_cmp(&db).then(b.total_cmp(a))
        })
        .map(|(l, _)| l)
}

/// One shard of a split model: its header, and its file when it is here.
pub struct Shard<'a> {
    pub header: &'a Header,
    pub path: Option<&'a Path>,
}

/// The tensor → shard file map of a split model (for
/// [`crate::weights::files_for_stage`]).
pub fn weight_map<'a>(
    shards: impl IntoIterator<Item = (&'a str, &'a Header)>,
) -> BTreeMap<String, String> {
    shards
        .into_iter()
        .flat_map(|(file, header)| {
            header
                .tensors
                .iter()
                .map(move |t| (t.name.clone(), file.to_string()))
        })
        .collect()
}

/// Writes the one GGUF file that holds a split model (`shards` in split
/// order): the first shard's metadata without the split keys, every
/// tensor's entry, and the data of the shards that are here. The tensors
/// of shards that are not (a pipeline stage needs only some) are listed
/// after the end of the file, so reading one is an error, never zeros.
/// Returns the joined file's length.
pub fn join(shards: &[Shard<'_>], out: &Path) -> Result<u64, GgufError> {
    let first = shards
        .first()
        .ok_or_else(|| GgufError::Invalid("no shards to join".into()))?;
    if first.path.is_none() {
        return Err(GgufError::Invalid(
            "the first shard (the metadata) is needed".into(),
        ));
    }
    let alignment = first.header.alignment;
    let mut header = Header {
        version: 3,
        metadata: first
            .header
            .metadata
            .iter()
            .filter(|e| !e.key.starts_with("split."))
            .cloned()
            .collect(),
        tensors: Vec::new(),
        alignment,
        data_offset: 0,
    };
    // Present shards' data first, in order; absent ones' after the end.
    let order: Vec<&Shard> = shards
        .iter()
        .filter(|s| s.path.is_some())
        .chain(shards.iter().filter(|s| s.path.is_none()))
        .collect();
    let mut base = 0u64;
    let mut copies = Vec::new();
    for shard in &order {
        if shard.header.alignment != alignment {
            return Err(GgufError::Invalid(format!(
                "shards aligned to {} and {alignment} bytes",
                shard.header.alignment
            )));
        }
        let len = shard_data_len(shard)?;
        header
            .tensors
            .extend(shard.header.tensors.iter().map(|t| TensorInfo {
                offset: base + t.offset,
                ..t.clone()
            }));
        if let Some(path) = shard.path {
            copies.push((path, shard.header.data_offset, len));
        }
        base = align(base + len, alignment);
    }
    write_joined(&header, &copies, out)
}

/// The data bytes of a shard: the rest of its file when it is here, else
/// the end of its last tensor.
fn shard_data_len(shard: &Shard<'_>) -> Result<u64, GgufError> {
    match shard.path {
        Some(path) => {
            let len = std::fs::metadata(path).map_err(GgufError::io(path))?.len();
            Ok(len.saturating_sub(shard.header.data_offset))
        }
        None => shard.header.data_len().ok_or_else(|| {
            GgufError::Invalid("a tensor of a type of unknown size in a missing shard".into())
        }),
    }
}

fn write_joined(
    header: &Header,
    copies: &[(&Path, u64, u64)],
    out: &Path,
) -> Result<u64, GgufError> {
    let partial = crate::partial_path(out);
    let mut file = std::fs::File::create(&partial).map_err(GgufError::io(&partial))?;
    let bytes = header.to_bytes();
    file.write_all(&bytes).map_err(GgufError::io(&partial))?;
    let mut written = bytes.len() as u64;
    for (path, offset, len) in copies {
        let padded = align(written - bytes.len() as u64, header.alignment) + bytes.len() as u64;
        file.seek(SeekFrom::Start(padded))
            .map_err(GgufError::io(&partial))?;
        let mut source = std::fs::File::open(path).map_err(GgufError::io(path))?;
        source
            .seek(SeekFrom::Start(*offset))
            .map_err(GgufError::io(path))?;
        // On Linux `io::copy` between files is `copy_file_range`.
        let copied =
            std::io::copy(&mut source.take(*len), &mut file).map_err(GgufError::io(path))?;
        if copied != *len {
            return Err(GgufError::Invalid(format!(
                "{}: {copied} of {len} data bytes",
                path.display()
            )));
        }
        written = padded + copied;
    }
    file.set_len(written).map_err(GgufError::io(&partial))?;
    file.sync_all().map_err(GgufError::io(&partial))?;
    std::fs::rename(&partial, out).map_err(GgufError::io(out))?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny GGUF: two metadata entries (one an array of strings), two
    /// F32 tensors of 4 and 2 values.
    fn tiny(extra: &[MetaEntry]) -> (Header, Vec<u8>) {
        let mut strings = 9u32.to_le_bytes().to_vec();
        strings.extend(8u32.to_le_bytes());
        strings.extend(2u64.to_le_bytes());
        for s in ["a", "bc"] {
            put_string(&mut strings, s);
        }
        let mut metadata = vec![
            MetaEntry::string("general.architecture", "llama"),
            MetaEntry {
                key: "tokenizer.ggml.tokens".into(),
                value: MetaValue::Array {
                    elem_type: 8,
                    len: 2,
                },
                raw: strings,
            },
        ];
        metadata.extend(extra.iter().cloned());
        let header = Header {
            version: 3,
            metadata,
            tensors: vec![
                TensorInfo {
                    name: "blk.0.w".into(),
                    dims: vec![4],
                    ggml_type: 0,
                    offset: 0,
                },
                TensorInfo {
                    name: "blk.1.w".into(),
                    dims: vec![2],
                    ggml_type: 0,
                    offset: 32,
                },
            ],
            alignment: 32,
            data_offset: 0,
        };
        let mut bytes = header.to_bytes();
        let data_offset = bytes.len() as u64;
        let mut data = vec![0u8; 40];
        data.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        bytes.extend(&data);
        (
            Header {
                data_offset,
                ..header
            },
            bytes,
        )
    }

    #[test]
    fn a_header_parses_from_a_prefix_and_asks_for_more_when_short() {
        let (header, bytes) = tiny(&[]);
        let parsed = parse(&bytes).expect("parses");
        assert_eq!(parsed, header);
        assert_eq!(parsed.get_str("general.architecture"), Some("llama"));
        assert_eq!(parsed.data_len(), Some(40));
        // Only the header is needed, not the data.
        assert!(parse(&bytes[..header.data_offset as usize]).is_ok());
        let short = parse(&bytes[..30]).expect_err("short");
        assert!(matches!(short, GgufError::NeedMore { at_least, .. } if at_least > 30));
        assert!(matches!(parse(b"GGML...."), Err(GgufError::Invalid(_))));
        // Written again, the header is the same bytes.
        assert_eq!(parsed.to_bytes(), bytes[..header.data_offset as usize]);
    }

    #[test]
    fn reads_double_within_the_file() {
        assert_eq!(
            next_read(1 << 20, (1 << 20) + 5, 10 << 20).unwrap(),
            2 << 20
        );
        assert_eq!(next_read(1 << 20, 5 << 20, 10 << 20).unwrap(), 5 << 20);
        assert_eq!(next_read(1 << 20, (1 << 20) + 5, 5 << 18).unwrap(), 5 << 18);
        assert!(
            next_read(1 << 20, 2 << 20, 3 << 19).is_err(),
            "past the end"
        );
        assert!(next_read(100, 200, 100).is_err(), "nothing more to read");
    }

    #[test]
    fn file_names_give_splits_and_quantizations() {
        assert_eq!(
            parse_name("M.Q4_K_M-00002-of-00003.gguf"),
            Some(GgufName {
                stem: "M.Q4_K_M".into(),
                shard: Some((2, 3))
            })
        );
        assert_eq!(parse_name("M.Q8_0.gguf").and_then(|n| n.shard), None);
        assert_eq!(parse_name("M-1-of-3.gguf").and_then(|n| n.shard), None);
        assert_eq!(parse_name("config.json"), None);
        assert_eq!(shard_name("M", 2, 3), "M-00002-of-00003.gguf");
        assert_eq!(quant_of_name("SmolLM2.Q4_K_M.gguf"), Some("Q4_K_M"));
        assert_eq!(quant_of_name("smollm2-q4_k_m.gguf"), Some("Q4_K_M"));
        assert_eq!(quant_of_name("m-Q4_K.gguf"), Some("Q4_K"));
        assert_eq!(quant_of_name("m.Q4_1-00001-of-00002.gguf"), Some("Q4_1"));
        assert_eq!(quant_of_name("m-bf16.gguf"), Some("BF16"));
        assert_eq!(quant_of_name("m-f16.gguf"), Some("F16"));
        assert_eq!(quant_of_name("model.gguf"), None);
    }

    #[test]
    fn the_closest_quantization_is_the_nearest_in_bits() {
        let have = ["Q4_1", "Q8_0", "Q6_K"];
        assert_eq!(closest("Q4_K_M", &have), Some("Q4_1"));
        assert_eq!(closest("q8_0", &have), Some("Q8_0"));
        assert_eq!(closest("Q2_K", &["Q8_0", "F16"]), Some("Q8_0"));
        // A tie goes to the larger.
        assert_eq!(closest("Q4_1", &["Q4_K_L", "Q5_0"]), Some("Q4_K_L"));
        assert_eq!(closest("nonsense", &have), None);
    }

    #[test]
    fn shards_join_into_one_file_and_a_missing_shard_reads_past_the_end() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (whole, bytes) = tiny(&[]);
        // Split by hand: one tensor per shard.
        let split = |no: u16, tensor: usize, data: &[u8]| {
            let mut meta = if no == 0 {
                whole.metadata.clone()
            } else {
                vec![]
            };
            meta.push(MetaEntry::u16(SPLIT_NO, no));
            meta.push(MetaEntry::u16(SPLIT_COUNT, 2));
            meta.push(MetaEntry::i32(SPLIT_TENSORS_COUNT, 2));
            let header = Header {
                version: 3,
                metadata: meta,
                tensors: vec![TensorInfo {
                    offset: 0,
                    ..whole.tensors[tensor].clone()
                }],
                alignment: 32,
                data_offset: 0,
            };
            let mut out = header.to_bytes();
            out.extend(data);
            let path = tmp.path().join(shard_name("m", no as u32 + 1, 2));
            std::fs::write(&path, &out).expect("write");
            (parse(&out).expect("shard parses"), path)
        };
        let data = &bytes[whole.data_offset as usize..];
        let (h1, p1) = split(0, 0, &data[..16]);
        let (h2, p2) = split(1, 1, &data[32..40]);
        assert_eq!(h2.split(), Some((1, 2)));
        let out = tmp.path().join("m.gguf");
        let shards = [
            Shard {
                header: &h1,
                path: Some(&p1),
            },
            Shard {
                header: &h2,
                path: Some(&p2),
            },
        ];
        join(&shards, &out).expect("joins");
        let joined = std::fs::read(&out).expect("read");
        let header = parse(&joined).expect("joined parses");
        assert_eq!(header.split(), None);
        assert_eq!(header.tensors.len(), 2);
        let at = |t: &TensorInfo, n: usize| {
            let start = (header.data_offset + t.offset) as usize;
            joined[start..start + n].to_vec()
        };
        assert_eq!(at(&header.tensors[0], 16), data[..16]);
        assert_eq!(at(&header.tensors[1], 8), data[32..40]);
        // Without the first shard's partner: its tensor lies past the end.
        let partial = [
            Shard {
                header: &h1,
                path: Some(&p1),
            },
            Shard {
                header: &h2,
                path: None,
            },
        ];
        let len = join(&partial, &out).expect("joins");
        let header = parse(&std::fs::read(&out).expect("read")).expect("parses");
        assert!(header.data_offset + header.tensors[1].offset >= len);
        assert!(weight_map([("a", &h1), ("b", &h2)]).get("blk.1.w") == Some(&"b".to_string()));
    }
}
