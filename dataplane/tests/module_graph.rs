//! The modules of every crate in the workspace import each other top-down:
//! the graph of `crate::` references between a crate's top-level modules has
//! no cycle, and neither has the graph between the submodules of any module
//! (see ARCHITECTURE.md, "Module layers").
//!
//! The graph is read from the sources: module `NAME` is `src/NAME.rs` plus
//! everything under `src/NAME/`, and it depends on every other top-level
//! module it names as `crate::OTHER` (in a path or a `use crate::{…}` group).
//! Inside a module `M` (a folder `src/…/M/`), submodule `NAME` is `M/NAME.rs`
//! plus everything under `M/NAME/`, and it depends on a sibling it names as
//! `crate::…::M::OTHER` or, from `M/NAME.rs` itself, as `super::OTHER`.
//! Comment lines (doc links included) and `#[cfg(test)]` items are left out:
//! test code may reach across (a policy test builds the cache it configures),
//! and so may a module's `tests.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Module → the files that reference each other module.
type Graph = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

/// The workspace's crates, by their folder beside this one.
const CRATES: [&str; 5] = ["dataplane", "controlplane", "oqpctl", "proto", "tests"];

/// The crates whose submodules are held to the same rule: all but the test support crate,
/// whose fake Ollama's parts (its state, handle and streams) still reach into each other.
const LAYERED_INSIDE: [&str; 4] = ["dataplane", "controlplane", "oqpctl", "proto"];

#[test]
fn top_level_modules_import_each_other_without_a_cycle() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for name in CRATES {
        let src = workspace.join(name).join("src");
        let graph = graph(&src, &src);
        if name == "dataplane" {
            // The reading works: the request path is seen to read the shared state.
            assert!(
                graph
                    .get("service")
                    .is_some_and(|deps| deps.contains_key("app")),
                "no `service -> app` edge found: the source scan is broken"
            );
        }
        assert_no_cycle(name, &graph);
    }
}

#[test]
fn the_submodules_of_every_module_import_each_other_without_a_cycle() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut read = 0;
    for name in LAYERED_INSIDE {
        let src = workspace.join(name).join("src");
        let mut folders = Vec::new();
        module_folders(&src, &mut folders);
        for folder in folders {
            let graph = graph(&src, &folder);
            let shown = format!("{name}::{}", module_path(&src, &folder));
            if shown == "controlplane::config" {
                // The reading works: a section's resolver is seen to read the keys' one.
                assert!(
                    graph
                        .get("resolve")
                        .is_some_and(|deps| deps.contains_key("keys")),
                    "no `config::resolve -> config::keys` edge found: the source scan is broken"
                );
            }
            assert_no_cycle(&shown, &graph);
            read += 1;
        }
    }
    assert!(read > 10, "only {read} module folders found");
}

/// Panics, naming the files that tie it, if `graph` (the modules of `name`) has a cycle.
fn assert_no_cycle(name: &str, graph: &Graph) {
    if let Some(cycle) = find_cycle(graph) {
        let mut shown = String::new();
        for pair in cycle.windows(2) {
            let files = &graph[&pair[0]][&pair[1]];
            let files: Vec<&str> = files.iter().map(String::as_str).collect();
            shown.push_str(&format!(
                "\n  {} -> {}  ({})",
                pair[0],
                pair[1],
                files.join(", ")
            ));
        }
        panic!(
            "{name}'s modules import each other in a cycle: {}{shown}",
            cycle.join(" -> ")
        );
    }
}

/// Every folder below `dir` that holds the submodules of a module.
fn module_folders(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.push(path.clone());
            module_folders(&path, out);
        }
    }
}

/// The module path of `folder` below `src` (`grpc::admin`); empty for `src` itself.
fn module_path(src: &Path, folder: &Path) -> String {
    let relative = folder.strip_prefix(src).unwrap();
    let names: Vec<&str> = relative
        .components()
        .map(|part| part.as_os_str().to_str().unwrap())
        .collect();
    names.join("::")
}

/// The graph of the modules in `folder` (the crate's own when it is `src`).
fn graph(src: &Path, folder: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(folder, &mut files);
    let module_of = |file: &Path| -> String {
        let relative = file.strip_prefix(folder).unwrap();
        let first = relative.components().next().unwrap();
        let first = first.as_os_str().to_str().unwrap();
        first.strip_suffix(".rs").unwrap_or(first).to_owned()
    };
    let top = folder == src;
    let modules: BTreeSet<String> = files
        .iter()
        .map(|file| module_of(file))
        .filter(|name| !top || (name != "lib" && name != "main"))
        .collect();
    let mut graph: Graph = modules
        .iter()
        .map(|name| (name.clone(), BTreeMap::new()))
        .collect();
    let path = module_path(src, folder);
    let full = if top {
        "crate::".to_owned()
    } else {
        format!("crate::{path}::")
    };
    for file in &files {
        let from = module_of(file);
        if !modules.contains(&from) {
            continue;
        }
        let shown = file.strip_prefix(src).unwrap().display().to_string();
        let code = production_code(&fs::read_to_string(file).unwrap());
        let mut names = crate_references(&code, &full);
        // `super::` names a sibling only from a file directly in the folder.
        if !top && file.parent() == Some(folder) {
            names.extend(crate_references(&code, "super::"));
        }
        for to in names {
            if to != from && modules.contains(&to) {
                graph
                    .get_mut(&from)
                    .unwrap()
                    .entry(to)
                    .or_default()
                    .insert(shown.clone());
            }
        }
    }
    graph
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") && !path.ends_with("tests.rs") {
            out.push(path);
        }
    }
}

/// `source` without comment lines and without the items marked `#[cfg(test)]`.
fn production_code(source: &str) -> String {
    let mut kept = String::new();
    let mut lines = source.lines();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            continue;
        }
        if trimmed.starts_with("#[cfg(test)]") {
            skip_item(&mut lines);
            continue;
        }
        kept.push_str(line);
        kept.push('\n');
    }
    kept
}

/// Skips the item after a `#[cfg(test)]`: up to its `;` (`mod tests;`) or
/// `,` (a field), or to the `}` that closes its first `{`.
fn skip_item<'a>(lines: &mut impl Iterator<Item = &'a str>) {
    let mut depth = 0usize;
    let mut parens = 0usize;
    let mut opened = false;
    for line in lines {
        if line.trim_start().starts_with("//") {
            continue;
        }
        for c in code_chars(line) {
            match c {
                '{' => {
                    depth += 1;
                    opened = true;
                }
                '}' => depth = depth.saturating_sub(1),
                '(' | '[' => parens += 1,
                ')' | ']' => parens = parens.saturating_sub(1),
                ';' | ',' if !opened && parens == 0 => return,
                _ => {}
            }
        }
        if opened && depth == 0 {
            return;
        }
    }
}

/// The characters of `line` outside string and character literals and
/// trailing comments: enough to count braces.
fn code_chars(line: &str) -> Vec<char> {
    let chars: Vec<char> = line.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '/' if chars.get(i + 1) == Some(&'/') => break,
            // A raw string: r"…", r#"…"#, br#"…"#.
            'r' if matches!(chars.get(i + 1), Some('"' | '#')) => {
                let mut j = i + 1;
                let mut hashes = 0;
                while chars.get(j) == Some(&'#') {
                    hashes += 1;
                    j += 1;
                }
                if chars.get(j) != Some(&'"') {
                    out.push(c);
                    i += 1;
                    continue;
                }
                j += 1;
                loop {
                    match chars.get(j) {
                        None => return out,
                        Some('"') if (1..=hashes).all(|k| chars.get(j + k) == Some(&'#')) => {
                            i = j + 1 + hashes;
                            break;
                        }
                        Some(_) => j += 1,
                    }
                }
            }
            '"' => {
                let mut j = i + 1;
                loop {
                    match chars.get(j) {
                        None => return out,
                        Some('\\') => j += 2,
                        Some('"') => break,
                        Some(_) => j += 1,
                    }
                }
                i = j + 1;
            }
            // A character literal ('{', '\n'); a lifetime ('a) is left alone.
            '\'' if chars.get(i + 1) == Some(&'\\') => {
                let close = chars[i + 3..].iter().position(|&c| c == '\'');
                i = close.map_or(chars.len(), |at| i + 4 + at);
            }
            '\'' if chars.get(i + 2) == Some(&'\'') => i += 3,
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// Every module named as `PREFIX NAME` (`prefix` is `crate::`, `crate::config::` or
/// `super::`), alone or in a `use crate::{A, B::C}` group.
fn crate_references(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        // `crate::config::` is not a part of `other_crate::config::`, nor `super::` of `self::super::`.
        let whole = rest[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'));
        rest = &rest[at + prefix.len()..];
        if !whole {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            // The group's top-level names, up to its closing brace.
            let mut depth = 0usize;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        names.insert(first_segment(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    item.push(c);
                }
            }
            names.insert(first_segment(&item));
        } else {
            names.insert(first_segment(rest));
        }
    }
    names.remove("");
    names
}

/// The identifier `text` starts with (after any whitespace).
fn first_segment(text: &str) -> String {
    text.trim_start()
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// A cycle of `graph`, as `[a, b, …, a]`, if there is one.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        graph: &Graph,
        node: &str,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        marks.insert(node.to_owned(), Mark::Open);
        path.push(node.to_owned());
        for next in graph[node].keys() {
            match marks.get(next.as_str()) {
                Some(Mark::Open) => {
                    let start = path.iter().position(|n| n == next).unwrap();
                    let mut cycle = path[start..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                Some(Mark::Done) => {}
                None => {
                    if let Some(cycle) = visit(graph, next, marks, path) {
                        return Some(cycle);
                    }
                }
            }
        }
        path.pop();
        marks.insert(node.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in graph.keys() {
        if !marks.contains_key(node.as_str()) {
            let mut path = Vec::new();
            if let Some(cycle) = visit(graph, node, &mut marks, &mut path) {
                return Some(cycle);
            }
        }
    }
    None
}

#[test]
fn references_are_read_from_paths_and_groups_but_not_from_comments_or_tests() {
    let code = production_code(
        "use crate::alpha::One;\n\
         use crate::{beta, gamma::{Two, Three}, delta::Four};\n\
         /// See [`crate::epsilon`].\n\
         fn f() { crate::zeta::call(\"}\", '{', '\\''); }\n\
         struct S {\n\
             #[cfg(test)]\n\
             field: crate::iota::Field,\n\
             kept: crate::kappa::Kept,\n\
         }\n\
         #[cfg(test)]\n\
         mod tests {\n\
             use crate::eta;\n\
             const S: &[u8] = br#\"{\"#;\n\
         }\n\
         #[cfg(test)]\n\
         mod more;\n\
         use crate::theta;\n",
    );
    let names: Vec<String> = crate_references(&code, "crate::").into_iter().collect();
    assert_eq!(
        names,
        ["alpha", "beta", "delta", "gamma", "kappa", "theta", "zeta"].map(String::from)
    );
}

#[test]
fn submodules_are_read_from_their_full_path_and_from_super() {
    let code = production_code(
        "use super::resolve::duration_within;\n\
         use super::{keys, schema::RawKey};\n\
         use crate::config::cloud::RawCloud;\n\
         use oqp_controlplane::config::net::Url;\n\
         fn f() { crate::balances::attach(); }\n",
    );
    let names: Vec<String> = crate_references(&code, "crate::config::")
        .into_iter()
        .chain(crate_references(&code, "super::"))
        .collect();
    assert_eq!(
        names,
        ["cloud", "keys", "resolve", "schema"].map(String::from)
    );
    // The circle the config loader once had is found.
    let mut graph = Graph::new();
    for (from, to) in [
        ("cloud", "resolve"),
        ("resolve", "keys"),
        ("keys", "schema"),
        ("schema", "cloud"),
    ] {
        graph
            .entry(from.to_owned())
            .or_default()
            .insert(to.to_owned(), BTreeSet::new());
    }
    let cycle = find_cycle(&graph).unwrap();
    assert_eq!(cycle.len(), 5, "{cycle:?}");
}
