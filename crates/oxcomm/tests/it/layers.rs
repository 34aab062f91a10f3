//! The library's layers (docs/architecture.md, "Layers of the library"): every `crate::…` and
//! `super::…` path in `crates/oxcomm/src` must point at a layer its own layer may import, by
//! the table below, which mirrors the doc's import table. Adding an import that runs up (the
//! engine naming a transport's or an algorithm's type, logging importing algorithms, comm
//! building a backend, …) fails here, naming the file, the line and the layers.
//!
//! Paths in comments and doc links are not imports and are skipped; a `super::` path resolves
//! against the file's module path (in an inline `mod tests` it is the file's own module, which
//! is never another layer).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Layers, bottom first, each with the top-level modules it holds.
const LAYERS: &[(&str, &[&str])] = &[
    ("values", &["dtype", "reduce", "wire", "error", "copy", "unwind", "buffers", "clock"]),
    ("rendezvous", &["rendezvous"]),
    ("transport", &["transport"]),
    ("engine", &["engine"]),
    ("algorithms", &["algorithms"]),
    ("backend", &["backend"]),
    ("logging", &["logging"]),
    ("comm", &["comm"]),
    ("composite", &["compression", "object"]),
    ("entry", &["init", "grow", "threads", "mpi", "world", "fuzz", "lib"]),
];

/// Which layers each layer may import (its own included): the doc's import table.
const MAY_IMPORT: &[(&str, &[&str])] = &[
    ("values", &["values"]),
    ("rendezvous", &["values", "rendezvous"]),
    ("transport", &["values", "rendezvous", "transport"]),
    ("engine", &["values", "transport", "engine"]),
    ("algorithms", &["values", "transport", "engine", "algorithms"]),
    ("backend", &["values", "transport", "engine", "algorithms", "backend"]),
    ("logging", &["values", "logging"]),
    ("comm", &["values", "transport", "engine", "algorithms", "backend", "logging", "comm"]),
    ("composite", &["values", "engine", "comm", "composite"]),
    (
        "entry",
        &[
            "values",
            "rendezvous",
            "transport",
            "engine",
            "algorithms",
            "backend",
            "logging",
            "comm",
            "composite",
            "entry",
        ],
    ),
];

/// Paths that a file may not name although its layer may import the module: `(files, path,
/// why)`, where `files` is a path under `src` or a prefix of one.
const NEVER: &[(&str, &str, &str)] = &[
    ("engine.rs", "transport::shm", "the engine knows links and doorbells, not a transport"),
    ("engine.rs", "transport::tcp", "the engine knows links and doorbells, not a transport"),
    ("engine.rs", "transport::inproc", "the engine knows links and doorbells, not a transport"),
    ("engine.rs", "transport::mixed", "the engine knows links and doorbells, not a transport"),
    ("comm/", "backend::native", "backends are built by the entry points"),
    ("comm/", "backend::mpi", "backends are built by the entry points"),
    ("algorithms/star.rs", "shm_direct", "link algorithms meet the direct path through Ctx::watched"),
    ("algorithms/barrier.rs", "shm_direct", "link algorithms meet the direct path through Ctx::watched"),
    ("algorithms/ring.rs", "shm_direct", "link algorithms meet the direct path through Ctx::watched"),
    ("algorithms/tree.rs", "shm_direct", "link algorithms meet the direct path through Ctx::watched"),
    ("algorithms/doubling.rs", "shm_direct", "link algorithms meet the direct path through Ctx::watched"),
    ("algorithms/pairwise.rs", "shm_direct", "link algorithms meet the direct path through Ctx::watched"),
];

/// The layer of top-level module `module`, if it is one of the crate's.
fn layer_of(module: &str) -> Option<&'static str> {
    LAYERS.iter().find(|(_, mods)| mods.contains(&module)).map(|(layer, _)| *layer)
}

/// Whether `from` may import `to`.
fn may_import(from: &str, to: &str) -> bool {
    MAY_IMPORT.iter().any(|(l, allowed)| *l == from && allowed.contains(&to))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a source file relative to `src` (`algorithms/shm_direct/mod.rs` →
/// `[algorithms, shm_direct]`; `lib.rs` → `[lib]`).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let file = parts.pop().unwrap();
    let stem = file.trim_end_matches(".rs");
    if stem != "mod" {
        parts.push(stem.to_string());
    }
    parts
}

/// The leading identifier of `s`.
fn ident(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The top-level modules a line's code (not its comments) names through `crate::` or
/// `super::` paths, resolved from the file at `module`.
fn imported_modules(code: &str, module: &[String]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        // `$crate::` in macros and identifiers that end in `crate` are not this crate's paths.
        let before = code[..i].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let rest = &code[i + "crate::".len()..];
        if let Some(list) = rest.strip_prefix('{') {
            for item in list.split([',', '}']).map(|i| ident(i.trim())).filter(|i| !i.is_empty()) {
                out.insert(item.to_string());
            }
        } else {
            out.insert(ident(rest).to_string());
        }
    }
    for (i, _) in code.match_indices("super::") {
        // Count this `super::` only at the start of a path.
        if code[..i].ends_with("super::") {
            continue;
        }
        let mut rest = &code[i..];
        let mut up = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            up += 1;
            rest = r;
        }
        if up < module.len() {
            out.insert(module[0].clone());
        } else {
            // Up to the crate root: the next name is the top-level module (or, inside an
            // inline `mod tests` of a top-level file, an item of the file's own module).
            let name = ident(rest);
            out.insert(if layer_of(name).is_some() { name.to_string() } else { module[0].clone() });
        }
    }
    out
}

/// The code of a line: without a `//` comment (outside string literals, roughly: a `//`
/// after an odd number of quotes is inside a string).
fn code_of(line: &str) -> &str {
    let mut from = 0;
    while let Some(at) = line[from..].find("//") {
        let at = from + at;
        if line[..at].matches('"').count() % 2 == 0 {
            return &line[..at];
        }
        from = at + 2;
    }
    line
}

/// Every import in `src` that runs against the table: `file:line: layer → layer (module)`.
fn violations(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    assert!(files.len() > 50, "read only {} files under {}", files.len(), src.display());
    let mut bad = Vec::new();
    for path in files {
        let rel = path.strip_prefix(src).unwrap();
        let module = module_path(rel);
        let own = layer_of(&module[0]).unwrap_or_else(|| {
            panic!("{}: module `{}` is in no layer of this test's table (add it)", rel.display(), module[0])
        });
        let text = std::fs::read_to_string(&path).unwrap();
        let rel_s = rel.to_string_lossy().replace('\\', "/");
        for (n, line) in text.lines().enumerate() {
            for (_, what, why) in NEVER.iter().filter(|(f, _, _)| rel_s.starts_with(f)) {
                if code_of(line).contains(what) {
                    bad.push(format!("{}:{}: names `{what}` ({why}): {}", rel.display(), n + 1, line.trim()));
                }
            }
            for m in imported_modules(code_of(line), &module) {
                let Some(theirs) = layer_of(&m) else { continue };
                if !may_import(own, theirs) {
                    bad.push(format!("{}:{}: {own} → {theirs} (`{m}`): {}", rel.display(), n + 1, line.trim()));
                }
            }
        }
    }
    bad
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn every_import_points_down_the_layer_table() {
    let bad = violations(&src_dir());
    assert!(bad.is_empty(), "imports against docs/architecture.md's table:\n{}", bad.join("\n"));
}

/// The check itself: an upward import in a copy of the tree is reported.
#[test]
fn an_upward_import_is_reported() {
    let dir = std::env::temp_dir().join(format!("oxcomm-layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    for f in &files {
        let to = dir.join(f.strip_prefix(src_dir()).unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(f, &to).unwrap();
    }
    let engine = dir.join("engine.rs");
    let text = std::fs::read_to_string(&engine).unwrap();
    std::fs::write(&engine, format!("{text}\nuse crate::algorithms::Algorithm; // an upward import\n")).unwrap();
    let flight = dir.join("logging/flight.rs");
    let text = std::fs::read_to_string(&flight).unwrap();
    std::fs::write(&flight, format!("{text}\nfn f() {{ let _ = super::super::transport::Transport::Tcp; }}\n"))
        .unwrap();
    let bad = violations(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(bad.len(), 2, "{bad:#?}");
    assert!(bad[0].starts_with("engine.rs:") && bad[0].contains("engine → algorithms"), "{bad:#?}");
    assert!(bad[1].starts_with("logging/flight.rs:") && bad[1].contains("logging → transport"), "{bad:#?}");
}

#[test]
fn super_paths_resolve_against_the_module_path() {
    let m = |p: &str| module_path(Path::new(p));
    assert_eq!(m("algorithms/shm_direct/mod.rs"), ["algorithms", "shm_direct"]);
    assert_eq!(m("engine.rs"), ["engine"]);
    let got = imported_modules("use super::super::ring; use crate::{dtype::Element, wire};", &m("algorithms/x/y.rs"));
    assert_eq!(got.into_iter().collect::<Vec<_>>(), ["algorithms", "dtype", "wire"]);
    let got = imported_modules("use super::transport::Link;", &m("engine.rs"));
    assert_eq!(got.into_iter().collect::<Vec<_>>(), ["transport"]);
    assert_eq!(code_of("let s = \"a // b\"; // crate::comm"), "let s = \"a // b\"; ");
}
