//! The flat options format: a plugin that declares it receives `[backends.<name>]` as sorted
//! `key=value` lines instead of TOML text (simpler to parse in C).

use crate::domain::{DomainError, DomainErrorKind};

/// The backend's TOML options as the flat `key=value` lines of
/// [`OPTIONS_FLAT`](super::abi::OPTIONS_FLAT).
pub fn flat_options(toml_text: &str) -> Result<String, DomainError> {
    let table: toml::Table = toml_text.parse().map_err(|e: toml::de::Error| {
        DomainError::new(DomainErrorKind::InvalidArgument, e.message().to_owned())
    })?;
    let mut lines = Vec::new();
    flatten("", &table, &mut lines);
    lines.sort();
    Ok(lines.concat())
}

/// A value's text: strings escape `\` as `\\`, a newline as `\n` and a comma as `\,`, so an
/// unescaped comma always separates array elements (`["a,b", "c"]` is `a\,b,c`, not three).
fn flat_value(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => s
            .replace('\\', "\\\\")
            .replace('\n', "\\n")
            .replace(',', "\\,"),
        toml::Value::Array(items) => items.iter().map(flat_value).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

fn flatten(prefix: &str, table: &toml::Table, lines: &mut Vec<String>) {
    for (key, value) in table {
        let key = format!("{prefix}{key}");
        match value {
            toml::Value::Table(inner) => flatten(&format!("{key}."), inner, lines),
            other => lines.push(format!("{key}={}\n", flat_value(other))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_flatten_to_sorted_key_value_lines() {
        let flat = flat_options(
            "b = true\nname = \"two\\nlines\"\nsizes = [1, 2]\n[faults]\ndelay_ms = 3\n",
        )
        .unwrap();
        assert_eq!(
            flat,
            "b=true\nfaults.delay_ms=3\nname=two\\nlines\nsizes=1,2\n"
        );
        assert_eq!(flat_options("").unwrap(), "");
        assert!(flat_options("= broken").is_err());
    }

    /// Issue 26: commas inside array strings were not escaped: `["a,b", "c"]` read as three
    /// elements.
    #[test]
    fn commas_and_backslashes_inside_strings_are_escaped() {
        assert_eq!(
            flat_options("a = [\"a,b\", \"c\"]\nb = [\"a\", \"b\", \"c\"]\nc = 'x\\,y'\n").unwrap(),
            "a=a\\,b,c\nb=a,b,c\nc=x\\\\\\,y\n"
        );
    }
}
