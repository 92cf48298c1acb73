//! Route tables as files: what `lbagent route import` reads and
//! `lbagent route export` writes.
//!
//! Two formats, one row per node, fields `modid`, `cmdid`, `ip` (dotted
//! IPv4), `port`, `weight`, and (appended for issue 31, optional, so that
//! older files import unchanged) `zone` and `labels`:
//!
//! - CSV: a header line naming the five fields and any of `zone`,
//!   `labels` (any order), then one line per node, comma-separated, no
//!   quoting (no field needs it). An empty `zone` or `labels` is none;
//!   labels are `k=v;k2=v2` (`;` between labels, since `,` separates
//!   fields). Blank lines and lines starting with `#` are skipped.
//! - JSON lines: one object per line,
//!   `{"modid":1,"cmdid":2,"ip":"10.0.0.1","port":80,"weight":1}`, with
//!   optional `"zone":"eu-1"` and `"labels":"version=canary,tier=gold"`;
//!   the five are required and no other field is allowed. Blank lines
//!   are skipped.
//!
//! Export writes the `zone` and `labels` columns only when some node has
//! a zone or a label, so a store without any exports exactly what older
//! versions wrote (and read).
//!
//! [`TableFormat::detect`] picks the format from the file name (`.csv`;
//! `.jsonl`, `.ndjson`, `.json`), else from the first line that is not
//! blank (`{` starts JSON lines).
//!
//! Every row is checked with the rules of `route add`
//! ([`check_imported_node`]: a unicast address, a port in `1..=65535`, a
//! weight in `0..=`[`super::MAX_WEIGHT`], the capacity left: 0 is a node
//! with none left, as export writes it); a node listed twice for one module is a bad row
//! too, and so is a zone or labels outside the model's bounds (1 to 63 bytes
//! of `A-Z a-z 0-9 . _ -`, at most 16 labels, each key once). [`parse`] returns every good row or, when any row is bad, the bad
//! rows with their line numbers.

use std::collections::HashSet;
use std::fmt;
use std::io::{self, Write};
use std::net::Ipv4Addr;
use std::path::Path;

use super::{check_imported_node, ModuleRoute, TableMeta, TableRow};
use lbagent_model::{Labels, ModuleId, NodeAddr, NodeMeta, RouteNode, Zone};

/// The fields of a row, in the order export writes them.
pub const FIELDS: [&str; 5] = ["modid", "cmdid", "ip", "port", "weight"];

/// The optional fields, after [`FIELDS`]: a node's zone and labels.
pub const META_FIELDS: [&str; 2] = ["zone", "labels"];

/// A route table read by [`parse`]: its rows, and the zones and labels of
/// the nodes that have any (what [`crate::Store::import_table`] takes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    /// Every row, in file order.
    pub rows: Vec<TableRow>,
    /// The zone and labels of each row that has either, in file order.
    pub meta: Vec<TableMeta>,
}

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
    #[serde(default)]
    zone: Option<String>,
    #[serde(default)]
    labels: Option<String>,
}

/// Where each field is in a CSV line: [`FIELDS`] always, [`META_FIELDS`]
/// when the header names them.
#[derive(Clone, Copy)]
struct Columns {
    fields: [usize; 5],
    zone: Option<usize>,
    labels: Option<usize>,
    count: usize,
}

/// A row as read, before the checks: its module, node and metadata.
type RawRow = (ModuleId, RouteNode, NodeMeta);

/// The rows of a route table, checked, in file order, with their zones
/// and labels.
///
/// # Errors
/// [`BadTable`] listing every bad row (with a CSV header that is wrong,
/// only the header) when any row is bad.
pub fn parse(text: &str, format: TableFormat) -> Result<Table, BadTable> {
    let mut table = Table::default();
    let mut bad = Vec::new();
    let mut seen = HashSet::new();
    let mut columns: Option<Columns> = None;
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
        match raw.and_then(|(m, node, meta)| checked(m, node).map(|(m, n)| (m, n, meta))) {
            Ok((m, node, _)) if !seen.insert((m, node.addr)) => bad.push(BadRow {
                line: n,
                why: format!("module {m} node {} is listed twice", node.addr),
            }),
            Ok((m, node, meta)) => {
                if !meta.is_empty() {
                    table.meta.push((m, node.addr, meta));
                }
                table.rows.push((m, node));
            }
            Err(why) => bad.push(BadRow { line: n, why }),
        }
    }
    if bad.is_empty() {
        Ok(table)
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

/// The column of each of [`FIELDS`] (and of [`META_FIELDS`] it names) in
/// a CSV header.
fn header(line: &str) -> Result<Columns, String> {
    let names: Vec<&str> = line.split(',').map(str::trim).collect();
    let mut cols = [0usize; 5];
    let mut meta = [None; 2];
    for (f, col) in META_FIELDS.iter().zip(meta.iter_mut()) {
        let found: Vec<usize> = (0..names.len()).filter(|&i| names[i] == *f).collect();
        match found[..] {
            [] => {}
            [i] => *col = Some(i),
            _ => {
                return Err(format!(
                    "the CSV header `{}` names `{f}` twice",
                    quote(line)
                ))
            }
        }
    }
    let expected = FIELDS.len() + meta.iter().flatten().count();
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
    if names.len() != expected {
        return Err(format!(
            "the CSV header `{}` has {} columns: it names exactly {}, and may name {}",
            quote(line),
            names.len(),
            FIELDS.join(","),
            META_FIELDS.join(",")
        ));
    }
    Ok(Columns {
        fields: cols,
        zone: meta[0],
        labels: meta[1],
        count: expected,
    })
}

fn csv_row(line: &str, cols: &Columns) -> Result<RawRow, String> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    if fields.len() != cols.count {
        return Err(format!(
            "{} fields, not {} (as the header names)",
            fields.len(),
            cols.count,
        ));
    }
    let f = |k: usize| fields[cols.fields[k]];
    let num = |k: usize| -> Result<u32, String> {
        f(k).parse::<u32>().map_err(|_| {
            format!(
                "{} `{}` is not an integer in 0..=4294967295",
                FIELDS[k],
                quote(f(k))
            )
        })
    };
    let (m, node) = row(num(0)?, num(1)?, f(2), num(3)?, num(4)?)?;
    let zone = cols.zone.map(|i| fields[i]).filter(|z| !z.is_empty());
    let labels = cols.labels.map(|i| fields[i]).filter(|l| !l.is_empty());
    let labels = labels.map(|l| l.replace(';', ","));
    Ok((m, node, meta(zone, labels.as_deref())?))
}

fn json_row(line: &str) -> Result<RawRow, String> {
    // serde_json quotes the offending value in its message: clip it too.
    let r: JsonRow = serde_json::from_str(line)
        .map_err(|e| format!("bad JSON row: {}", quote(&e.to_string())))?;
    let (m, node) = row(r.modid, r.cmdid, &r.ip, r.port, r.weight)?;
    let meta = meta(r.zone.as_deref(), r.labels.as_deref())?;
    Ok((m, node, meta))
}

/// A row's zone and labels (`k=v,k2=v2`), checked with the model's bounds.
fn meta(zone: Option<&str>, labels: Option<&str>) -> Result<NodeMeta, String> {
    let zone = zone
        .map(str::parse::<Zone>)
        .transpose()
        .map_err(|e| quote(&e.to_string()).into_owned())?;
    let labels = labels
        .map(str::parse::<Labels>)
        .transpose()
        .map_err(|e| quote(&e.to_string()).into_owned())?
        .unwrap_or_default();
    Ok(NodeMeta { zone, labels })
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
    let with_meta = routes.iter().any(|r| !r.meta.is_empty());
    if format == TableFormat::Csv {
        if with_meta {
            writeln!(out, "{},{}", FIELDS.join(","), META_FIELDS.join(","))?;
        } else {
            writeln!(out, "{}", FIELDS.join(","))?;
        }
    }
    let none = NodeMeta::default();
    for r in routes {
        // Both sorted by address: one walk pairs each node with its meta.
        let mut metas = r.meta.iter().peekable();
        for n in &r.nodes {
            while metas.next_if(|(a, _)| *a < n.addr).is_some() {}
            let meta = metas
                .next_if(|(a, _)| *a == n.addr)
                .map_or(&none, |(_, m)| m);
            let (m, ip) = (r.module, Ipv4Addr::from(n.addr.ip));
            match format {
                TableFormat::Csv => {
                    write!(
                        out,
                        "{},{},{ip},{},{}",
                        m.modid, m.cmdid, n.addr.port, n.weight
                    )?;
                    if with_meta {
                        let zone = meta.zone.as_ref().map_or("", |z| z.as_str());
                        let labels = meta.labels.to_string().replace(',', ";");
                        write!(out, ",{zone},{labels}")?;
                    }
                    writeln!(out)?;
                }
                TableFormat::Jsonl => {
                    write!(
                        out,
                        r#"{{"modid":{},"cmdid":{},"ip":"{ip}","port":{},"weight":{}"#,
                        m.modid, m.cmdid, n.addr.port, n.weight
                    )?;
                    // Zones and labels need no escaping: A-Z a-z 0-9 . _ - = ,
                    if let Some(z) = &meta.zone {
                        write!(out, r#","zone":"{z}""#)?;
                    }
                    if !meta.labels.is_empty() {
                        write!(out, r#","labels":"{}""#, meta.labels)?;
                    }
                    writeln!(out, "}}")?;
                }
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
        let rows = parse(t, TableFormat::Csv).unwrap().rows;
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
        let rows = parse(t, TableFormat::Jsonl).unwrap().rows;
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
                meta: vec![],
            },
            ModuleRoute {
                module: ModuleId::new(7, 0),
                version: 4,
                nodes: vec![node("192.168.1.1:65535", 1_000_000)],
                options: Default::default(),
                policy: lbagent_model::Policy::L5,
                meta: vec![],
            },
        ];
        for format in [TableFormat::Csv, TableFormat::Jsonl] {
            let mut out = Vec::new();
            write(&mut out, &routes, format).unwrap();
            let text = String::from_utf8(out).unwrap();
            if format == TableFormat::Csv {
                assert!(
                    text.starts_with("modid,cmdid,ip,port,weight\n"),
                    "no zone or label: the old header, for older importers"
                );
            }
            let rows = parse(&text, format).unwrap().rows;
            let back: Vec<(ModuleId, RouteNode)> = routes
                .iter()
                .flat_map(|r| r.nodes.iter().map(move |n| (r.module, *n)))
                .collect();
            assert_eq!(rows, back, "{format:?}");
            assert_eq!(TableFormat::detect(Path::new("t"), &text), format);
        }
    }

    fn meta(zone: &str, labels: &str) -> NodeMeta {
        NodeMeta {
            zone: (!zone.is_empty()).then(|| zone.parse().unwrap()),
            labels: labels.parse().unwrap(),
        }
    }

    #[test]
    fn zones_and_labels_survive_write_then_parse_in_both_formats() {
        let a = ModuleId::new(1, 2);
        let routes = vec![ModuleRoute {
            module: a,
            version: 3,
            nodes: vec![
                node("10.0.0.1:80", 5),
                node("10.0.0.2:81", 1),
                node("10.0.0.3:82", 0),
            ],
            policy: lbagent_model::Policy::L5,
            options: Default::default(),
            meta: vec![
                (node("10.0.0.1:80", 0).addr, meta("eu-1", "")),
                (
                    node("10.0.0.3:82", 0).addr,
                    meta("us-2", "version=canary,tier=gold"),
                ),
            ],
        }];
        for format in [TableFormat::Csv, TableFormat::Jsonl] {
            let mut out = Vec::new();
            write(&mut out, &routes, format).unwrap();
            let text = String::from_utf8(out).unwrap();
            let t = parse(&text, format).unwrap();
            assert_eq!(t.rows.len(), 3, "{text}");
            let want: Vec<TableMeta> = routes[0]
                .meta
                .iter()
                .map(|(addr, m)| (a, *addr, m.clone()))
                .collect();
            assert_eq!(t.meta, want, "{format:?}: {text}");
        }
    }

    #[test]
    fn old_files_import_and_meta_columns_are_optional_in_any_order() {
        let old = "modid,cmdid,ip,port,weight\n1,2,10.0.0.1,80,1\n";
        assert!(parse(old, TableFormat::Csv).unwrap().meta.is_empty());
        let t = "labels,ip,port,modid,cmdid,weight,zone\n\
                 a=1;b=2,10.0.0.1,80,1,2,1,eu-1\n\
                 ,10.0.0.2,80,1,2,1,\n";
        let t = parse(t, TableFormat::Csv).unwrap();
        assert_eq!(t.rows.len(), 2);
        assert_eq!(
            t.meta,
            vec![(
                ModuleId::new(1, 2),
                node("10.0.0.1:80", 0).addr,
                meta("eu-1", "a=1,b=2")
            )]
        );
        let only_zone = "modid,cmdid,ip,port,weight,zone\n1,2,10.0.0.1,80,1,eu-1\n";
        assert_eq!(parse(only_zone, TableFormat::Csv).unwrap().meta.len(), 1);
    }

    #[test]
    fn a_bad_zone_or_label_is_named_by_line_and_bounded() {
        let huge = "z".repeat(1 << 20);
        let seventeen: Vec<String> = (0..17).map(|i| format!("k{i}=v")).collect();
        let t = format!(
            "modid,cmdid,ip,port,weight,zone,labels\n\
             1,2,10.0.0.1,80,1,eu 1,\n\
             1,2,10.0.0.2,80,1,{huge},\n\
             1,2,10.0.0.3,80,1,eu,version\n\
             1,2,10.0.0.4,80,1,eu,a=1;a=2\n\
             1,2,10.0.0.5,80,1,eu,{}\n\
             1,2,10.0.0.6,80,1,eu,ok=1\n\
             1,2,10.0.0.7,80,1,eu,ok=1,extra\n",
            seventeen.join(";")
        );
        let bad = parse(&t, TableFormat::Csv).unwrap_err();
        let lines: Vec<usize> = bad.rows.iter().map(|r| r.line).collect();
        assert_eq!(lines, vec![2, 3, 4, 5, 6, 8]);
        let whys: Vec<&str> = bad.rows.iter().map(|r| r.why.as_str()).collect();
        assert!(whys[0].contains("zone `eu 1`"), "{}", whys[0]);
        assert!(whys[1].contains("at most 63"), "{}", whys[1]);
        assert!(whys[2].contains("KEY=VALUE"), "{}", whys[2]);
        assert!(whys[3].contains("twice"), "{}", whys[3]);
        assert!(whys[4].contains("at most 16"), "{}", whys[4]);
        assert!(
            bad.to_string().len() < 4 * QUOTE_MAX,
            "{}",
            quote(&bad.to_string())
        );
        let j = format!(
            r#"{{"modid":1,"cmdid":1,"ip":"10.0.0.1","port":80,"weight":1,"zone":"{huge}"}}"#
        );
        let bad = parse(&j, TableFormat::Jsonl).unwrap_err();
        assert!(
            bad.rows[0].why.contains("at most 63"),
            "{}",
            bad.rows[0].why
        );
        let dup = "modid,cmdid,ip,port,weight,zone,zone\n";
        assert!(parse(dup, TableFormat::Csv).unwrap_err().rows[0]
            .why
            .contains("twice"));
        let extra = "modid,cmdid,ip,port,weight,colour\n";
        assert!(parse(extra, TableFormat::Csv).unwrap_err().rows[0]
            .why
            .contains("may name zone,labels"));
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
