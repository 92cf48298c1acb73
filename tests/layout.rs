//! The layout documents stay true: the workspace's layout section (the book's "Code layout" page) names
//! every crate, every source file at the top of each crate and every module
//! of the `lbagent` package; and every crate root's `//! # Layout` list
//! names every module the crate declares. Adding a file or a module without
//! saying where it belongs fails here, naming it.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// The document that holds the workspace's layout, and the heading it is
/// found under.
const LAYOUT_DOC: &str = "docs/src/design/layout.md";
const LAYOUT_HEADING: &str = "## Layout";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The layout section: from its heading to the next heading of its level.
fn layout_section() -> String {
    let text = fs::read_to_string(repo().join(LAYOUT_DOC)).unwrap();
    let start = text
        .find(&format!("\n{LAYOUT_HEADING}\n"))
        .unwrap_or_else(|| panic!("{LAYOUT_DOC} has no `{LAYOUT_HEADING}` section"));
    let rest = &text[start + 1..];
    let level = LAYOUT_HEADING.split(' ').next().unwrap();
    let end = rest[1..]
        .find(&format!("\n{level} "))
        .map_or(rest.len(), |e| e + 1);
    rest[..end].to_string()
}

/// The entries of the layout's tree under `src/`: each line indented two
/// spaces starts one (`  agent/   ...`), the more deeply indented lines
/// after it continue it.
fn src_entries(section: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in section.lines() {
        if let Some(rest) = line.strip_prefix("  ") {
            if !rest.starts_with(' ') && !rest.is_empty() {
                let name = rest.split_whitespace().next().unwrap().to_string();
                out.insert(name.clone(), rest.to_string());
                current = Some(name);
                continue;
            }
            if let Some(name) = &current {
                let e = out.get_mut(name).unwrap();
                e.push(' ');
                e.push_str(rest.trim());
            }
            continue;
        }
        current = None;
    }
    out
}

fn is_crate(dir: &Path) -> bool {
    dir.join("Cargo.toml").is_file()
}

fn rs_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "rs"))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn src_dirs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(repo().join("src"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir() && p.file_name().unwrap() != "vendor")
        .collect();
    v.sort();
    v
}

#[test]
fn the_layout_section_names_every_crate_and_every_file_in_it() {
    let section = layout_section();
    let entries = src_entries(&section);
    let mut missing = Vec::new();
    for dir in src_dirs() {
        let name = format!("{}/", dir.file_name().unwrap().to_string_lossy());
        let Some(entry) = entries.get(&name) else {
            missing.push(format!("src/{name} has no entry"));
            continue;
        };
        if !is_crate(&dir) {
            continue; // a module directory of the lbagent package
        }
        for f in rs_files(&dir) {
            if f == "lib.rs" {
                continue;
            }
            if !entry.contains(&f) {
                missing.push(format!("src/{name}{f} is not named in the `{name}` entry"));
            }
        }
    }
    for f in rs_files(&repo().join("src")) {
        if !entries.contains_key(&f) {
            missing.push(format!("src/{f} has no entry"));
        }
    }
    for vendored in fs::read_dir(repo().join("src/vendor")).unwrap() {
        let name = vendored.unwrap().file_name().to_string_lossy().into_owned();
        if !entries.contains_key(&format!("vendor/{name}/")) {
            missing.push(format!("src/vendor/{name}/ has no entry"));
        }
    }
    assert!(
        missing.is_empty(),
        "{LAYOUT_DOC}'s `{LAYOUT_HEADING}` section is out of date:\n  {}",
        missing.join("\n  ")
    );
}

/// The modules a crate root declares (`mod x;`, `pub mod x;`, ...), less
/// those compiled for tests only.
fn declared_modules(root: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut test_only = false;
    for line in root.lines() {
        let t = line.trim();
        if t.starts_with("#[cfg(test)]") {
            test_only = true;
            continue;
        }
        if t.starts_with("#[") {
            continue;
        }
        let decl = t
            .strip_prefix("pub mod ")
            .or_else(|| t.strip_prefix("pub(crate) mod "))
            .or_else(|| t.strip_prefix("mod "));
        if let Some(d) = decl.and_then(|d| d.strip_suffix(';')) {
            if !test_only {
                out.push(d.to_string());
            }
        }
        test_only = false;
    }
    out
}

/// The `//! # Layout` list of a crate root: from that heading to the end of
/// the inner doc comment (or the next heading).
fn layout_list(root: &str) -> Option<String> {
    let doc: Vec<&str> = root
        .lines()
        .take_while(|l| l.starts_with("//!"))
        .map(|l| l.trim_start_matches("//!"))
        .collect();
    let start = doc.iter().position(|l| l.trim() == "# Layout")?;
    let body: Vec<&str> = doc[start + 1..]
        .iter()
        .take_while(|l| !l.trim_start().starts_with("# "))
        .copied()
        .collect();
    Some(body.join("\n"))
}

#[test]
fn every_crate_root_lists_every_module_it_declares() {
    let mut roots = vec![(repo().join("src/lib.rs"), "lbagent".to_string())];
    for dir in src_dirs() {
        if is_crate(&dir) {
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            roots.push((dir.join("lib.rs"), format!("lbagent-{name}")));
        }
    }
    let mut problems = Vec::new();
    for (path, krate) in roots {
        let root = fs::read_to_string(&path).unwrap();
        let modules = declared_modules(&root);
        if modules.is_empty() {
            continue;
        }
        let Some(list) = layout_list(&root) else {
            problems.push(format!(
                "{krate} ({}) has no `//! # Layout` list",
                path.display()
            ));
            continue;
        };
        for m in modules {
            if !list.contains(&format!("`{m}`")) {
                problems.push(format!(
                    "{krate}: module `{m}` is not in its `//! # Layout` list"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_section_parser_sees_entries_and_their_continuations() {
    let s = "## Layout\n```\nsrc/\n  a/     one\n         two.rs\n  b.rs   three\nx\n```\n";
    let e = src_entries(s);
    assert_eq!(e.len(), 2);
    assert!(e["a/"].contains("two.rs"));
    assert!(!e["b.rs"].contains("two.rs"));
    assert_eq!(
        declared_modules("mod a;\n#[cfg(test)]\nmod tests;\npub mod b;\n"),
        ["a", "b"]
    );
    assert_eq!(
        layout_list("//! x\n//! # Layout\n//! - [`a`]\n//! # Other\n//! `b`\nmod a;").unwrap(),
        " - [`a`]"
    );
}
