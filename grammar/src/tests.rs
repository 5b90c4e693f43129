use super::*;

/// A small vocabulary: every byte, some words, and two control tokens
/// (`<end>` ends generation, `<tool>` is one a grammar may name).
fn vocabulary() -> Vocabulary {
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for word in [
        "{\"", "\": ", "name", "age", "true", "false", "null", "12", "\"}", ", \"",
    ] {
        tokens.push(word.as_bytes().to_vec());
    }
    let mut control = vec![false; tokens.len()];
    tokens.push(b"<end>".to_vec());
    control.push(true);
    tokens.push(b"<tool>".to_vec());
    control.push(true);
    // An unused id: never allowed.
    tokens.push(Vec::new());
    control.push(false);
    let end = u32::try_from(tokens.len() - 3).unwrap();
    Vocabulary {
        tokens,
        control,
        end: vec![end],
    }
}

/// Decodes under `constraint` with logits from a fixed pseudo-random
/// sequence (a stand-in for a model that ignores the constraint), greedy
/// over what the mask allows; the text and whether it ended on `<end>`.
fn decode(constraint: &Constraint, seed: u64, steps: usize) -> (String, bool) {
    let vocabulary = vocabulary();
    let end = vocabulary.end[0];
    let words = vocabulary.tokens.clone();
    let grammars = Grammars::new(vocabulary).unwrap();
    let mut mask = grammars.compile(constraint).unwrap();
    let mut state = seed;
    let mut text = Vec::new();
    for _ in 0..steps {
        let mut logits: Vec<f32> = (0..words.len())
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 40) as f32 / (1u64 << 24) as f32
            })
            .collect();
        // A model that would rather stop than go on.
        logits[end as usize] = 0.9;
        mask.apply(&mut logits).unwrap();
        let (token, best) =
            logits
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |acc, (i, &l)| if l > acc.1 { (i, l) } else { acc },
                );
        assert!(best.is_finite(), "the mask left no token");
        let token = token as u32;
        assert!(mask.allowed(token));
        if token == end {
            return (String::from_utf8(text).unwrap(), true);
        }
        mask.accept(token).unwrap();
        text.extend_from_slice(&words[token as usize]);
    }
    (String::from_utf8(text).unwrap(), false)
}

#[test]
fn a_schema_makes_any_model_write_json_that_validates() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    });
    for seed in 0..8 {
        let (text, ended) = decode(&Constraint::JsonSchema(schema.clone()), seed, 400);
        assert!(ended, "seed {seed}: did not end: {text}");
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let name = value["name"].as_str().unwrap();
        assert!(name.chars().count() <= 8, "{text}");
        let age = value["age"].as_i64().unwrap();
        assert!((0..=120).contains(&age), "{text}");
        let tags = value["tags"].as_array().unwrap();
        assert!((1..=3).contains(&tags.len()), "{text}");
        assert!(tags.iter().all(|t| t == "a" || t == "b"), "{text}");
        assert_eq!(value.as_object().unwrap().len(), 3, "{text}");
    }
}

#[test]
fn json_object_regex_and_lark_hold_their_shape() {
    for seed in 0..4 {
        let (text, ended) = decode(&Constraint::JsonObject, seed, 400);
        assert!(ended);
        // JSON's grammar allows exponents past f64's range, which
        // serde_json (unlike Python's json) refuses.
        match serde_json::from_str::<serde_json::Map<String, Value>>(&text) {
            Ok(_) => {}
            Err(e) => assert!(e.to_string().contains("number out of range"), "{e}: {text}"),
        }
    }

    let (text, ended) = decode(&Constraint::Regex("[0-9]{3}-[a-c]{2}".into()), 5, 50);
    assert!(ended);
    assert_eq!(text.len(), 6, "{text}");
    assert!(
        text.as_bytes()[..3].iter().all(u8::is_ascii_digit),
        "{text}"
    );

    let lark = r#"start: "yes" | "no" | "maybe: " NUMBER
NUMBER: /[0-9]+/"#;
    for seed in 0..4 {
        let (text, ended) = decode(&Constraint::Lark(lark.into()), seed, 50);
        assert!(ended);
        assert!(
            text == "yes"
                || text == "no"
                || text
                    .strip_prefix("maybe: ")
                    .is_some_and(|n| n.parse::<u64>().is_ok()),
            "{text}"
        );
    }
}

#[test]
fn a_grammar_may_name_a_control_token_and_text_never_spells_one() {
    let lark = r#"start: <tool> "x""#;
    let vocabulary = vocabulary();
    let tool = u32::try_from(vocabulary.tokens.len() - 2).unwrap();
    let grammars = Grammars::new(vocabulary).unwrap();
    let mut mask = grammars.compile(&Constraint::Lark(lark.into())).unwrap();
    let mut logits = vec![0.0; 270];
    mask.apply(&mut logits).unwrap();
    let allowed: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    assert_eq!(allowed, vec![tool as usize]);
    // Free text may not produce a control token.
    let mut free = grammars.compile(&Constraint::Regex(".*".into())).unwrap();
    let mut logits = vec![0.0; 270];
    free.apply(&mut logits).unwrap();
    assert!(logits[tool as usize].is_infinite());
    assert!(logits[usize::from(b'<')].is_finite());
}

#[test]
fn a_finished_constraint_allows_only_the_end() {
    let vocabulary = vocabulary();
    let end = vocabulary.end[0] as usize;
    let grammars = Grammars::new(vocabulary).unwrap();
    let mut mask = grammars.compile(&Constraint::Regex("ok".into())).unwrap();
    for byte in *b"ok" {
        mask.apply(&mut vec![0.0; 270]).unwrap();
        mask.accept(u32::from(byte)).unwrap();
    }
    let mut logits = vec![0.0; 270];
    mask.apply(&mut logits).unwrap();
    let allowed: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    assert_eq!(allowed, vec![end]);
}

#[test]
fn what_cannot_compile_is_refused_with_the_reason() {
    let bad = [
        Constraint::JsonSchema(serde_json::json!({"type": "nonsense"})),
        Constraint::JsonSchema(serde_json::json!({"$ref": "#/definitions/missing"})),
        Constraint::Regex("(unclosed".into()),
        Constraint::Lark("start: undefined_rule".into()),
    ];
    for constraint in bad {
        let error = check(&constraint).expect_err("refused");
        let text = error.to_string();
        assert!(
            text.starts_with(&format!("the {} constraint", constraint.kind())),
            "{text}"
        );
        assert!(!text.contains('\n'), "{text}");
    }
    assert!(check(&Constraint::JsonObject).is_ok());
    assert!(check(&Constraint::JsonSchema(
        serde_json::json!({"type": "array", "items": {"type": "number"}})
    ))
    .is_ok());
}

#[test]
fn the_mask_covers_ids_beyond_the_vocabulary() {
    let mut mask = SimpleVob::alloc(40);
    mask.allow_token(3);
    mask.allow_token(33);
    // A model whose logits are padded past its vocabulary.
    let mut logits = vec![1.0; 70];
    mask_logits(&mask, &mut logits);
    let allowed: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    assert_eq!(allowed, vec![3, 33]);
}
