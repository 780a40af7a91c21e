//! Deserialization of the members that take one item or a batch (`tokens`, `text`,
//! `prompt`). serde's `untagged` tries each variant in turn and, when none fits, reports only
//! "data did not match any variant": a token id of 2^64 or a number among texts would be
//! refused without saying which element is wrong. Here each element is read as what it can be,
//! so the error names the element (`tokens[3]`) and what was expected there.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Unexpected, Visitor};
use serde::Deserialize;

use crate::{PromptInput, TextInput, TokensInput};

/// What an element of a batch may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Id,
    Ids,
    Text,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Id => "a token id",
            Self::Ids => "a list of token ids",
            Self::Text => "a string",
        }
    }
}

enum Element {
    Id(i64),
    Ids(Vec<i64>),
    Text(String),
}

impl Element {
    fn kind(&self) -> Kind {
        match self {
            Self::Id(_) => Kind::Id,
            Self::Ids(_) => Kind::Ids,
            Self::Text(_) => Kind::Text,
        }
    }
}

const TOKEN_ID: &str = "a token id (an integer below 2^63)";

/// A token id: any integer that fits i64 (the vocabulary check comes later and names the
/// value); a float or a larger integer is refused here, naming the value.
struct TokenId(i64);

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_i64(TokenIdVisitor).map(TokenId)
    }
}

struct TokenIdVisitor;

impl Visitor<'_> for TokenIdVisitor {
    type Value = i64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(TOKEN_ID)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<i64, E> {
        Ok(v)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<i64, E> {
        i64::try_from(v).map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<i64, E> {
        Err(E::invalid_value(Unexpected::Float(v), &self))
    }
}

/// One element of a batch: one of `allowed`, and of the first element's kind after it.
#[derive(Clone, Copy)]
struct ElementSeed<'a> {
    allowed: &'a [Kind],
    first: Option<Kind>,
}

impl ElementSeed<'_> {
    fn check<E: de::Error>(&self, kind: Kind, found: Unexpected<'_>) -> Result<(), E> {
        let fits = self.allowed.contains(&kind) && self.first.is_none_or(|f| f == kind);
        if fits {
            Ok(())
        } else {
            Err(E::invalid_type(found, self))
        }
    }
}

impl<'de> DeserializeSeed<'de> for ElementSeed<'_> {
    type Value = Element;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Element, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ElementSeed<'_> {
    type Value = Element;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.first {
            Some(kind) => write!(f, "{}, as the first element is", kind.name()),
            None => {
                let names: Vec<&str> = self.allowed.iter().map(|k| k.name()).collect();
                f.write_str(&names.join(" or "))
            }
        }
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Element, E> {
        self.check(Kind::Id, Unexpected::Signed(v))?;
        Ok(Element::Id(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Element, E> {
        self.check(Kind::Id, Unexpected::Unsigned(v))?;
        TokenIdVisitor.visit_u64(v).map(Element::Id)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Element, E> {
        self.check(Kind::Id, Unexpected::Float(v))?;
        TokenIdVisitor.visit_f64(v).map(Element::Id)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Element, E> {
        self.check(Kind::Text, Unexpected::Str(v))?;
        Ok(Element::Text(v.to_string()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Element, E> {
        self.check(Kind::Text, Unexpected::Str(&v))?;
        Ok(Element::Text(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Element, A::Error> {
        self.check(Kind::Ids, Unexpected::Seq)?;
        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(TokenId(id)) = seq.next_element()? {
            ids.push(id);
        }
        Ok(Element::Ids(ids))
    }
}

/// A member that is one string (when `text` is allowed at the top) or a list of elements.
enum Parsed {
    Text(String),
    List(Vec<Element>),
}

struct BatchVisitor {
    /// A plain string is one item (`text`, `prompt`), not a list.
    top_level_text: bool,
    elements: &'static [Kind],
    expecting: &'static str,
}

impl<'de> Visitor<'de> for BatchVisitor {
    type Value = Parsed;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Parsed, E> {
        self.visit_string(v.to_string())
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Parsed, E> {
        if self.top_level_text {
            Ok(Parsed::Text(v))
        } else {
            Err(E::invalid_type(Unexpected::Str(&v), &self))
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Parsed, A::Error> {
        let mut seed = ElementSeed {
            allowed: self.elements,
            first: None,
        };
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(element) = seq.next_element_seed(seed)? {
            seed.first = Some(element.kind());
            out.push(element);
        }
        Ok(Parsed::List(out))
    }
}

fn parse<'de, D: Deserializer<'de>>(d: D, visitor: BatchVisitor) -> Result<Parsed, D::Error> {
    if visitor.top_level_text {
        d.deserialize_any(visitor)
    } else {
        d.deserialize_seq(visitor)
    }
}

// The element kinds of one list are all the same (checked while reading), so each collection
// below takes what it expects and the rest of the arms cannot occur.
fn ids(list: Vec<Element>) -> Vec<i64> {
    list.into_iter()
        .filter_map(|e| match e {
            Element::Id(id) => Some(id),
            _ => None,
        })
        .collect()
}

fn id_lists(list: Vec<Element>) -> Vec<Vec<i64>> {
    list.into_iter()
        .filter_map(|e| match e {
            Element::Ids(ids) => Some(ids),
            _ => None,
        })
        .collect()
}

fn texts(list: Vec<Element>) -> Vec<String> {
    list.into_iter()
        .filter_map(|e| match e {
            Element::Text(t) => Some(t),
            _ => None,
        })
        .collect()
}

fn first_kind(list: &[Element]) -> Option<Kind> {
    list.first().map(Element::kind)
}

impl<'de> Deserialize<'de> for TokensInput {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let visitor = BatchVisitor {
            top_level_text: false,
            elements: &[Kind::Id, Kind::Ids],
            expecting: "a list of token ids, or a list of such lists",
        };
        Ok(match parse(d, visitor)? {
            Parsed::List(list) if first_kind(&list) == Some(Kind::Ids) => {
                Self::Batch(id_lists(list))
            }
            Parsed::List(list) => Self::Single(ids(list)),
            // (The visitor refuses a string here already.)
            Parsed::Text(_) => return Err(de::Error::custom("expected a list of token ids")),
        })
    }
}

impl<'de> Deserialize<'de> for TextInput {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let visitor = BatchVisitor {
            top_level_text: true,
            elements: &[Kind::Text],
            expecting: "a string or a list of strings",
        };
        Ok(match parse(d, visitor)? {
            Parsed::Text(text) => Self::Single(text),
            Parsed::List(list) => Self::Batch(texts(list)),
        })
    }
}

impl<'de> Deserialize<'de> for PromptInput {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let visitor = BatchVisitor {
            top_level_text: true,
            elements: &[Kind::Id, Kind::Ids, Kind::Text],
            expecting: "a string, a list of strings, a list of token ids or a list of such lists",
        };
        Ok(match parse(d, visitor)? {
            Parsed::Text(text) => Self::Text(text),
            Parsed::List(list) => match first_kind(&list) {
                // An empty list is an empty batch, as the untagged order had it.
                None | Some(Kind::Ids) => Self::TokenBatch(id_lists(list)),
                Some(Kind::Id) => Self::Tokens(ids(list)),
                Some(Kind::Text) => Self::Texts(texts(list)),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(json: &str) -> Result<TokensInput, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn accepts_what_the_untagged_enums_accepted() {
        assert_eq!(tokens("[1, -2]"), Ok(TokensInput::Single(vec![1, -2])));
        assert_eq!(tokens("[]"), Ok(TokensInput::Single(vec![])));
        assert_eq!(
            tokens("[[1], [], [9223372036854775807]]"),
            Ok(TokensInput::Batch(vec![vec![1], vec![], vec![i64::MAX]]))
        );
        let text: TextInput = serde_json::from_str(r#"["a", "b"]"#).unwrap();
        assert_eq!(text, TextInput::Batch(vec!["a".into(), "b".into()]));
        let text: TextInput = serde_json::from_str(r#""a""#).unwrap();
        assert_eq!(text, TextInput::Single("a".into()));
        for (json, expect) in [
            (r#""x""#, PromptInput::Text("x".into())),
            ("[]", PromptInput::TokenBatch(vec![])),
            ("[1, 2]", PromptInput::Tokens(vec![1, 2])),
            ("[[1, 2]]", PromptInput::TokenBatch(vec![vec![1, 2]])),
            (
                r#"["x", "y"]"#,
                PromptInput::Texts(vec!["x".into(), "y".into()]),
            ),
        ] {
            assert_eq!(serde_json::from_str::<PromptInput>(json).unwrap(), expect);
        }
    }

    #[test]
    fn refusals_say_what_was_expected_and_found() {
        for (json, found) in [
            (
                "[1, 18446744073709551616]",
                "floating point `1.8446744073709552e+19`",
            ),
            (
                "[1, 18446744073709551615]",
                "integer `18446744073709551615`",
            ),
            ("[[1], [1.5]]", "floating point `1.5`"),
            ("[1, [2]]", "sequence"),
            (r#"[1, "2"]"#, "string \"2\""),
        ] {
            let err = tokens(json).unwrap_err();
            assert!(err.contains(found), "{json}: {err}");
            assert!(!err.contains("untagged"), "{json}: {err}");
        }
        assert!(tokens("[1, 1e30]").unwrap_err().contains(TOKEN_ID));
        let err = serde_json::from_str::<TextInput>(r#"["a", 1]"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("expected a string"), "{err}");
    }
}
