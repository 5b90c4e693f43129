//! How a sentence-transformers model makes one vector of its token states
//! (`1_Pooling/config.json`, in either the classic `pooling_mode_*_tokens`
//! flags or sentence-transformers 6's `pooling_mode`), and whether it
//! normalises it (a `Normalize` module in `modules.json`).

use serde_json::Value;

/// One vector of a sequence's token states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The first token's state (`[CLS]`): BGE.
    Cls,
    /// The mean over the tokens: all-MiniLM, E5.
    Mean,
    /// The elementwise maximum over the tokens.
    Max,
    /// The mean times the square root of the length.
    MeanSqrtLen,
    /// The last token's state: decoder embedders (Qwen3-Embedding).
    LastToken,
}

impl Pooling {
    /// The pooling a `1_Pooling/config.json` names; `None` when it names
    /// none or several (sentence-transformers would concatenate them).
    pub fn from_config(config: &Value) -> Option<Self> {
        if let Some(mode) = config.get("pooling_mode").and_then(Value::as_str) {
            return match mode {
                "cls" => Some(Self::Cls),
                "mean" => Some(Self::Mean),
                "max" => Some(Self::Max),
                "mean_sqrt_len_tokens" => Some(Self::MeanSqrtLen),
                "lasttoken" | "last_token" => Some(Self::LastToken),
                _ => None,
            };
        }
        let flag = |key: &str| config.get(key).and_then(Value::as_bool).unwrap_or(false);
        let chosen: Vec<Self> = [
            ("pooling_mode_cls_token", Self::Cls),
            ("pooling_mode_mean_tokens", Self::Mean),
            ("pooling_mode_max_tokens", Self::Max),
            ("pooling_mode_mean_sqrt_len_tokens", Self::MeanSqrtLen),
            ("pooling_mode_lasttoken", Self::LastToken),
        ]
        .into_iter()
        .filter(|(key, _)| flag(key))
        .map(|(_, pooling)| pooling)
        .collect();
        match chosen.as_slice() {
            [one] => Some(*one),
            _ => None,
        }
    }

    /// One vector of `states` (`tokens` rows of `width`, at least one row).
    pub fn pool(self, states: &[f32], width: usize) -> Vec<f32> {
        let rows: Vec<&[f32]> = states.chunks(width).collect();
        let n = rows.len().max(1) as f32;
        match self {
            Self::Cls => rows.first().map(|r| r.to_vec()).unwrap_or_default(),
            Self::LastToken => rows.last().map(|r| r.to_vec()).unwrap_or_default(),
            Self::Mean | Self::MeanSqrtLen => {
                let mut sum = vec![0.0f32; width];
                for row in &rows {
                    for (s, v) in sum.iter_mut().zip(row.iter()) {
                        *s += v;
                    }
                }
                let divide = if self == Self::Mean { n } else { n.sqrt() };
                sum.iter_mut().for_each(|s| *s /= divide);
                sum
            }
            Self::Max => {
                let mut max = vec![f32::NEG_INFINITY; width];
                for row in &rows {
                    for (m, v) in max.iter_mut().zip(row.iter()) {
                        *m = m.max(*v);
                    }
                }
                max
            }
        }
    }
}

/// Keeps the first `dimensions` values of a vector and scales them to unit
/// length again, as Matryoshka-trained models are read (0, or the whole
/// length: the vector as it is).
pub fn cut(vector: &mut Vec<f32>, dimensions: usize) {
    if dimensions == 0 || dimensions >= vector.len() {
        return;
    }
    vector.truncate(dimensions);
    normalize(vector);
}

/// Scales `v` to unit length, as `Normalize` (torch's `normalize`, with its
/// floor of 1e-12 on the norm).
pub fn normalize(v: &mut [f32]) {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= norm);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_cut_vector_is_unit_length_again() {
        let mut v = vec![3.0, 4.0, 12.0];
        cut(&mut v, 2);
        assert_eq!(v.len(), 2);
        assert!((v[0] - 0.6).abs() < 1e-6 && (v[1] - 0.8).abs() < 1e-6);
        let mut whole = vec![1.0, 2.0];
        cut(&mut whole, 0);
        assert_eq!(whole, vec![1.0, 2.0]);
        cut(&mut whole, 5);
        assert_eq!(whole, vec![1.0, 2.0]);
    }

    #[test]
    fn both_config_shapes_are_read() {
        let classic = json!({"word_embedding_dimension": 384, "pooling_mode_cls_token": false,
                             "pooling_mode_mean_tokens": true, "pooling_mode_max_tokens": false});
        assert_eq!(Pooling::from_config(&classic), Some(Pooling::Mean));
        assert_eq!(
            Pooling::from_config(&json!({"pooling_mode": "cls"})),
            Some(Pooling::Cls)
        );
        assert_eq!(
            Pooling::from_config(&json!({"pooling_mode": "lasttoken"})),
            Some(Pooling::LastToken)
        );
        let two = json!({"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": true});
        assert_eq!(Pooling::from_config(&two), None);
    }

    #[test]
    fn pools_and_normalises() {
        let states = [1.0, 2.0, 3.0, 6.0];
        assert_eq!(Pooling::Mean.pool(&states, 2), vec![2.0, 4.0]);
        assert_eq!(Pooling::Cls.pool(&states, 2), vec![1.0, 2.0]);
        assert_eq!(Pooling::LastToken.pool(&states, 2), vec![3.0, 6.0]);
        assert_eq!(Pooling::Max.pool(&states, 2), vec![3.0, 6.0]);
        let mut v = vec![3.0, 4.0];
        normalize(&mut v);
        assert_eq!(v, vec![0.6, 0.8]);
    }
}
