//! Route tables as files: what `lbagent route import` reads and
//! `lbagent route export` writes.
//!
//! Two formats, one row per node, fields `modid`, `cmdid`, `ip` (dotted
//! IPv4), `port`, `weight`:
//!
//! - CSV: a header line naming the five fields (any order), then one line
//!   per node, comma-separated, no quoting (no field needs it). Blank
//!   lines and lines starting with `#` are skipped.
//! - JSON lines: one object per line,
//!   `{"modid":1,"cmdid":2,"ip":"10.0.0.1","port":80,"weight":1}`; every
//!   field is required and no other is allowed. Blank lines are skipped.
//!
//! [`TableFormat::detect`] picks the format from the file name (`.csv`;
//! `.jsonl`, `.ndjson`, `.json`), else from the first line that is not
//! blank (`{` starts JSON lines).
//!
//! Every row is checked with the rules of `route add`
//! ([`check_imported_node`]: a unicast address, a port in `1..=65535`, a
//! weight in `0..=`[`super::MAX_WEIGHT`], the capacity left: 0 is a node
//! with none left, as export writes it); a node listed twice for one module is a bad row
//! too. [`parse`] returns every good row or, when any row is bad, the bad
//! rows with their line numbers.

use std::collections::HashSet;
use std::fmt;
use std::io::{self, Write};
use std::net::Ipv4Addr;
use std::path::Path;

use super::{check_imported_node, ModuleRoute};
use lbagent_model::{ModuleId, NodeAddr, RouteNode};

/// The fields of a row, in the order export writes them.
pub const FIELDS: [&str; 5] = ["modid", "cmdid", "ip", "port", "weight"];

/// How many bad rows [`BadTable`]'s message lists (the rest are counted).
pub const MAX_LISTED: usize = 20;

/// A route table's file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableFormat {
    /// Comma-separated values with a header line.
    Csv,
    /// One JSON object per line.
    Jsonl,
}

impl std::str::FromStr for TableFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "csv" => Ok(TableFormat::Csv),
            "jsonl" => Ok(TableFormat::Jsonl),
            _ => Err(format!("`{s}` is not a table format: use csv or jsonl")),
        }
    }
}

impl TableFormat {
    /// The format of the file at `path` holding `text`: by its extension,
    /// else by its first line that is not blank.
    pub fn detect(path: &Path, text: &str) -> TableFormat {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("csv") => return TableFormat::Csv,
            Some("jsonl" | "ndjson" | "json") => return TableFormat::Jsonl,
            _ => {}
        }
        let first = text.lines().map(str::trim).find(|l| !l.is_empty());
        match first {
            Some(l) if l.starts_with('{') => TableFormat::Jsonl,
            _ => TableFormat::Csv,
        }
    }
}

/// One bad row: its line number (from 1) and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadRow {
    /// The file's line number, from 1.
    pub line: usize,
    /// What is wrong with it.
    pub why: String,
}

/// A table with bad rows: every one of them, in line order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadTable {
    /// The bad rows (or the bad header, as line 1).
    pub rows: Vec<BadRow>,
}

impl fmt::Display for BadTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bad row{}, nothing imported:",
            self.rows.len(),
            if self.rows.len() == 1 { "" } else { "s" }
        )?;
        for r in self.rows.iter().take(MAX_LISTED) {
            write!(f, "\n  line {}: {}", r.line, r.why)?;
        }
        if self.rows.len() > MAX_LISTED {
            write!(f, "\n  ... and {} more", self.rows.len() - MAX_LISTED)?;
        }
        Ok(())
    }
}

impl std::error::Error for BadTable {}

/// A JSON line as written.
#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct JsonRow {
    modid: u32,
    cmdid: u32,
    ip: String,
    port: u32,
    weight: u32,
}

/// The rows of a route table, checked, in file order.
///
/// # Errors
/// [`BadTable`] listing every bad row (with a CSV header that is wrong,
/// only the header) when any row is bad.
pub fn parse(text: &str, format: TableFormat) -> Result<Vec<(ModuleId, RouteNode)>, BadTable> {
    let mut rows = Vec::new();
    let mut bad = Vec::new();
    let mut seen = HashSet::new();
    let mut columns: Option<[usize; 5]> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.trim();
        if line.is_empty() || (format == TableFormat::Csv && line.starts_with('#')) {
            continue;
        }
        let raw = match format {
            TableFormat::Jsonl => json_row(line),
            TableFormat::Csv => match columns {
                None => {
                    match header(line) {
                        Ok(c) => columns = Some(c),
                        Err(why) => {
                            return Err(BadTable {
                                rows: vec![BadRow { line: n, why }],
                            })
                        }
                    }
                    continue;
                }
                Some(c) => csv_row(line, &c),
            },
        };
        match raw.and_then(|(m, node)| checked(m, node)) {
            Ok((m, node)) if !seen.insert((m, node.addr)) => bad.push(BadRow {
                line: n,
                why: format!("module {m} node {} is listed twice", node.addr),
            }),
            Ok(row) => rows.push(row),
            Err(why) => bad.push(BadRow { line: n, why }),
        }
    }
    if bad.is_empty() {
        Ok(rows)
    } else {
        Err(BadTable { rows: bad })
    }
}

/// The most bytes of a field (or a line) an error quotes: a 100 MB field
/// is named, not echoed.
pub const QUOTE_MAX: usize = 200;

/// `text` as an error quotes it: whole up to [`QUOTE_MAX`] bytes, else its
/// first ones (cut at a character boundary) and how long it is.
pub fn quote(text: &str) -> std::borrow::Cow<'_, str> {
    if text.len() <= QUOTE_MAX {
        return text.into();
    }
    let mut end = QUOTE_MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes in all)", &text[..end], text.len()).into()
}

/// The column of each of [`FIELDS`] in a CSV header.
fn header(line: &str) -> Result<[usize; 5], String> {
    let names: Vec<&str> = line.split(',').map(str::trim).collect();
    let mut cols = [0usize; 5];
    for (f, col) in FIELDS.iter().zip(cols.iter_mut()) {
        let found: Vec<usize> = (0..names.len()).filter(|&i| names[i] == *f).collect();
        match found[..] {
            [i] => *col = i,
            [] => {
                return Err(format!(
                    "the CSV header `{}` has no `{f}` column: it names {}",
                    quote(line),
                    FIELDS.join(",")
                ))
            }
            _ => {
                return Err(format!(
                    "the CSV header `{}` names `{f}` twice",
                    quote(line)
                ))
            }
        }
    }
    if names.len() != FIELDS.len() {
        return Err(format!(
            "the CSV header `{}` has {} columns: it names exactly {}",
            quote(line),
            names.len(),
            FIELDS.join(",")
        ));
    }
    Ok(cols)
}

fn csv_row(line: &str, cols: &[usize; 5]) -> Result<(ModuleId, RouteNode), String> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    if fields.len() != FIELDS.len() {
        return Err(format!(
            "{} fields, not {} ({})",
            fields.len(),
            FIELDS.len(),
            FIELDS.join(",")
        ));
    }
    let f = |k: usize| fields[cols[k]];
    let num = |k: usize| -> Result<u32, String> {
        f(k).parse::<u32>().map_err(|_| {
            format!(
                "{} `{}` is not an integer in 0..=4294967295",
                FIELDS[k],
                quote(f(k))
            )
        })
    };
    row(num(0)?, num(1)?, f(2), num(3)?, num(4)?)
}

fn json_row(line: &str) -> Result<(ModuleId, RouteNode), String> {
    // serde_json quotes the offending value in its message: clip it too.
    let r: JsonRow = serde_json::from_str(line)
        .map_err(|e| format!("bad JSON row: {}", quote(&e.to_string())))?;
    row(r.modid, r.cmdid, &r.ip, r.port, r.weight)
}

fn row(
    modid: u32,
    cmdid: u32,
    ip: &str,
    port: u32,
    weight: u32,
) -> Result<(ModuleId, RouteNode), String> {
    let ip: Ipv4Addr = ip
        .parse()
        .map_err(|_| format!("ip `{}` is not a dotted IPv4 address", quote(ip)))?;
    let port = match u16::try_from(port) {
        Ok(p) if p != 0 => p,
        _ => return Err(format!("port {port} is not in 1..=65535")),
    };
    Ok((
        ModuleId::new(modid, cmdid),
        RouteNode {
            addr: NodeAddr::new(ip, port),
            weight,
        },
    ))
}

/// `route add`'s rules ([`check_imported_node`]).
fn checked(module: ModuleId, node: RouteNode) -> Result<(ModuleId, RouteNode), String> {
    let node = check_imported_node(module, node).map_err(|e| e.to_string())?;
    Ok((module, node))
}

/// Writes `routes` as a table in `format` (CSV with its header), one row
/// per node in module and node order: [`parse`] of it gives the same
/// routes back.
///
/// # Errors
/// What writing to `out` fails with.
pub fn write(out: &mut impl Write, routes: &[ModuleRoute], format: TableFormat) -> io::Result<()> {
    if format == TableFormat::Csv {
        writeln!(out, "{}", FIELDS.join(","))?;
    }
    for r in routes {
        for n in &r.nodes {
            let (m, ip) = (r.module, Ipv4Addr::from(n.addr.ip));
            match format {
                TableFormat::Csv => writeln!(
                    out,
                    "{},{},{ip},{},{}",
                    m.modid, m.cmdid, n.addr.port, n.weight
                )?,
                TableFormat::Jsonl => writeln!(
                    out,
                    r#"{{"modid":{},"cmdid":{},"ip":"{ip}","port":{},"weight":{}}}"#,
                    m.modid, m.cmdid, n.addr.port, n.weight
                )?,
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(s: &str, weight: u32) -> RouteNode {
        RouteNode {
            addr: s.parse().unwrap(),
            weight,
        }
    }

    #[test]
    fn csv_with_columns_in_any_order() {
        let t =
            "# a comment\nip, port,modid,cmdid,weight\n\n10.0.0.1,80,1,2,5\n10.0.0.2,81,1,2,1\n";
        let rows = parse(t, TableFormat::Csv).unwrap();
        assert_eq!(
            rows,
            vec![
                (ModuleId::new(1, 2), node("10.0.0.1:80", 5)),
                (ModuleId::new(1, 2), node("10.0.0.2:81", 1)),
            ]
        );
    }

    #[test]
    fn jsonl_rows() {
        let t = r#"{"modid":1,"cmdid":2,"ip":"10.0.0.1","port":80,"weight":5}

{"modid":3,"cmdid":4,"ip":"10.0.0.2","port":81,"weight":1}"#;
        let rows = parse(t, TableFormat::Jsonl).unwrap();
        assert_eq!(rows[1], (ModuleId::new(3, 4), node("10.0.0.2:81", 1)));
    }

    #[test]
    fn a_huge_field_is_quoted_to_its_first_200_bytes() {
        let huge = "9".repeat(1 << 20);
        let ip = "é".repeat(1 << 19);
        for (t, f) in [
            (
                format!("modid,cmdid,ip,port,weight\n{huge},1,10.0.0.1,80,1\n"),
                TableFormat::Csv,
            ),
            (
                format!("modid,cmdid,ip,port,weight\n1,1,{ip},80,1\n"),
                TableFormat::Csv,
            ),
            (format!("{huge},modid,cmdid,ip,port\n"), TableFormat::Csv),
            (
                format!(r#"{{"modid":1,"cmdid":1,"ip":"{ip}","port":80,"weight":{huge}}}"#),
                TableFormat::Jsonl,
            ),
            (
                format!(r#"{{"modid":1,"cmdid":1,"ip":"{ip}","port":80,"weight":1}}"#),
                TableFormat::Jsonl,
            ),
        ] {
            let e = parse(&t, f).unwrap_err().to_string();
            assert!(
                e.len() < 2 * QUOTE_MAX + 200,
                "{} bytes: {}",
                e.len(),
                quote(&e)
            );
        }
    }

    #[test]
    fn every_bad_row_is_named_by_line() {
        let t = "modid,cmdid,ip,port,weight\n\
                 1,2,10.0.0.1,80,1\n\
                 1,2,10.0.0.1,0,1\n\
                 1,2,224.0.0.1,80,1\n\
                 1,2,10.0.0.2,80,0\n\
                 1,2,10.0.0.2,80,1000001\n\
                 1,2,10.0.0.1,80,3\n\
                 1,x,10.0.0.1,80,3\n\
                 1,2,10.0.0.300,80,3\n\
                 1,2,10.0.0.3,70000,3\n\
                 1,2,10.0.0.3\n";
        let bad = parse(t, TableFormat::Csv).unwrap_err();
        let lines: Vec<usize> = bad.rows.iter().map(|r| r.line).collect();
        // Line 5, weight 0, is a node with no capacity left (what export
        // writes for a fully consumed node): not a bad row.
        assert_eq!(lines, vec![3, 4, 6, 7, 8, 9, 10, 11]);
        assert!(bad.rows[0].why.contains("port 0"), "{}", bad.rows[0].why);
        assert!(bad.rows[1].why.contains("unicast"), "{}", bad.rows[1].why);
        assert!(bad.rows[2].why.contains("1000001"), "{}", bad.rows[2].why);
        assert!(bad.rows[3].why.contains("twice"), "{}", bad.rows[3].why);
        assert!(bad.to_string().starts_with("8 bad rows, nothing imported:"));
    }

    #[test]
    fn a_long_list_is_cut_with_a_count() {
        let mut t = String::from("modid,cmdid,ip,port,weight\n");
        for i in 0..50 {
            t.push_str(&format!("{i},1,0.0.0.0,80,1\n"));
        }
        let msg = parse(&t, TableFormat::Csv).unwrap_err().to_string();
        assert_eq!(msg.matches("\n  line ").count(), MAX_LISTED);
        assert!(msg.ends_with("... and 30 more"), "{msg}");
    }

    #[test]
    fn a_bad_header_is_line_one() {
        let bad = parse("modid,cmdid,ip,port\n1,2,10.0.0.1,80\n", TableFormat::Csv).unwrap_err();
        assert_eq!(bad.rows.len(), 1);
        assert_eq!(bad.rows[0].line, 1);
        assert!(
            bad.rows[0].why.contains("no `weight`"),
            "{}",
            bad.rows[0].why
        );
        let bad = parse(
            r#"{"modid":1,"cmdid":2,"ip":"10.0.0.1","port":80,"weight":1,"x":1}"#,
            TableFormat::Jsonl,
        )
        .unwrap_err();
        assert!(
            bad.rows[0].why.contains("unknown field"),
            "{}",
            bad.rows[0].why
        );
    }

    #[test]
    fn write_then_parse_is_the_identity() {
        let routes = vec![
            ModuleRoute {
                module: ModuleId::new(1, 2),
                version: 3,
                nodes: vec![node("10.0.0.1:80", 5), node("10.0.0.2:81", 1)],
                policy: lbagent_model::Policy::L5,
                options: Default::default(),
            },
            ModuleRoute {
                module: ModuleId::new(7, 0),
                version: 4,
                nodes: vec![node("192.168.1.1:65535", 1_000_000)],
                options: Default::default(),
                policy: lbagent_model::Policy::L5,
            },
        ];
        for format in [TableFormat::Csv, TableFormat::Jsonl] {
            let mut out = Vec::new();
            write(&mut out, &routes, format).unwrap();
            let text = String::from_utf8(out).unwrap();
            let rows = parse(&text, format).unwrap();
            let back: Vec<(ModuleId, RouteNode)> = routes
                .iter()
                .flat_map(|r| r.nodes.iter().map(move |n| (r.module, *n)))
                .collect();
            assert_eq!(rows, back, "{format:?}");
            assert_eq!(TableFormat::detect(Path::new("t"), &text), format);
        }
    }

    #[test]
    fn detect_by_extension_first() {
        assert_eq!(
            TableFormat::detect(Path::new("a.CSV"), "{"),
            TableFormat::Csv
        );
        assert_eq!(
            TableFormat::detect(Path::new("a.jsonl"), "modid"),
            TableFormat::Jsonl
        );
        assert_eq!(
            TableFormat::detect(Path::new("a.txt"), "\n  {\"modid\":1}"),
            TableFormat::Jsonl
        );
    }
}
