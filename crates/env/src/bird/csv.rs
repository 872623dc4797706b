//! Just enough CSV (RFC 4180: quoted fields, doubled quotes, newlines inside quotes) to read
//! BIRD's `database_description/*.csv` files.

/// Decodes a description file's bytes: UTF-8 when valid (a byte-order mark is dropped), else
/// Latin-1, which several BIRD files use.
pub(crate) fn decode(bytes: &[u8]) -> String {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_string(),
        Err(_) => bytes.iter().map(|&b| char::from(b)).collect(),
    }
}

/// The records of `text`, each a list of fields, with the 1-based line each record starts on.
/// Errors on a quote left open at the end of the text, naming the line it opened on.
pub(crate) fn parse(text: &str) -> Result<Vec<(usize, Vec<String>)>, usize> {
    let mut records = Vec::new();
    let mut record = Vec::new();
    let mut field = String::new();
    let mut in_quotes = false;
    let mut line = 1;
    let mut record_line = 1;
    let mut quote_line = 1;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\n' {
            line += 1;
        }
        if in_quotes {
            match c {
                '"' if chars.peek() == Some(&'"') => {
                    chars.next();
                    field.push('"');
                }
                '"' => in_quotes = false,
                _ => field.push(c),
            }
            continue;
        }
        match c {
            '"' => {
                in_quotes = true;
                quote_line = line;
            }
            ',' => record.push(std::mem::take(&mut field)),
            '\r' => {}
            '\n' => {
                record.push(std::mem::take(&mut field));
                records.push((record_line, std::mem::take(&mut record)));
                record_line = line;
            }
            _ => field.push(c),
        }
    }
    if in_quotes {
        return Err(quote_line);
    }
    if !field.is_empty() || !record.is_empty() {
        record.push(field);
        records.push((record_line, record));
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_commas_and_newlines() {
        let text = "a,b\n\"x, y\",\"say \"\"hi\"\"\nthere\"\r\nlast,\n";
        let records = parse(text).unwrap();
        assert_eq!(
            records,
            vec![
                (1, vec!["a".to_string(), "b".to_string()]),
                (2, vec!["x, y".to_string(), "say \"hi\"\nthere".to_string()]),
                (4, vec!["last".to_string(), String::new()]),
            ]
        );
        assert_eq!(parse("a,\"open\nb"), Err(1));
    }

    #[test]
    fn latin1_fallback_and_bom() {
        assert_eq!(decode(b"\xEF\xBB\xBFname"), "name");
        assert_eq!(decode(b"caf\xE9"), "café");
    }
}
