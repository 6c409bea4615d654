//! The modules of src/ form layers (docs/architecture.md): each imports only from layers below it,
//! so no change can close an import cycle unnoticed. Read from the sources as they are, tests
//! (the `#[cfg(test)]` module ending a file) left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Lowest first. A module may import any module of a lower layer, none of its own or above.
const LAYERS: &[&[&str]] = &[
    // Bounded, quoted text for messages.
    &["text"],
    // Parsing and process plumbing.
    &["yaml", "kube_error", "listen", "supervise"],
    // Envoy's API by reflection: descriptors, protobuf JSON, merge, deterministic bytes.
    &["envoy_api"],
    // Istio's API: the kinds, their validation, mesh config.
    &["istio"],
    // The model: services, endpoint shards, config store, snapshots.
    &["model"],
    // What fills it and reads it at the bottom: registries, Kubernetes clients, metrics, leases.
    &["registry", "kube_client", "metrics", "leader"],
    // The mesh's registries together; the CA and caller identities.
    &["aggregate", "security"],
    // Proxies: xDS generation, the push path, the server and its introspection.
    &["xds"],
    // Where clusters and config come from; injection.
    &["sources", "inject"],
    // Views and tools over the whole: debug views, webhooks, manifests, doctor.
    &["debug", "webhook", "install", "doctor", "compare"],
    // Entry points: the admin server, flags, the remote-secret tool.
    &["admin", "config", "remote_secret"],
    // Wiring.
    &["app"],
];

/// Each top-level module of src/ and the modules it imports (`crate::<module>`), outside tests.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (parts, code) in sources("src") {
        let module = parts[0].trim_end_matches(".rs").to_string();
        if matches!(module.as_str(), "lib" | "main") {
            continue;
        }
        let imported = out.entry(module.clone()).or_default();
        for (at, _) in code.match_indices("crate::") {
            let name: String = code[at + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit())
                .collect();
            if !name.is_empty() && name != module {
                imported.insert(name);
            }
        }
    }
    out
}

/// Every Rust file below `dir` (relative to the crate): its path's components below `dir`, and its
/// code without the tests (the `#[cfg(test)]` module ending a file).
fn sources(dir: &str) -> Vec<(Vec<String>, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut out = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("readable source directory") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let parts = path
                .strip_prefix(&root)
                .expect("below the root")
                .components()
                .map(|c| c.as_os_str().to_str().expect("utf-8 name").to_string())
                .collect();
            let text = std::fs::read_to_string(&path).expect("readable source");
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            out.push((parts, code.to_string()));
        }
    }
    out
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

#[test]
fn every_module_imports_only_from_layers_below_it() {
    let mut wrong = Vec::new();
    for (module, imported) in imports() {
        let Some(layer) = layer_of(&module) else {
            wrong.push(format!(
                "{module} is in no layer: place it in tests/layering.rs"
            ));
            continue;
        };
        for target in imported {
            match layer_of(&target) {
                Some(below) if below < layer => {}
                Some(_) => wrong.push(format!(
                    "{module} imports {target}, of its own layer or above"
                )),
                None => wrong.push(format!("{module} imports {target}, which is in no layer")),
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_check_sees_an_import_upwards() {
    // A lower layer naming a higher one is what the check refuses.
    let (istio, app) = (layer_of("istio").unwrap(), layer_of("app").unwrap());
    assert!(istio < app);
    let imports = imports();
    assert!(
        imports["app"].contains("istio") && !imports["istio"].contains("app"),
        "the scan reads real imports"
    );
}

/// The generators of each proxy kind: none imports another, and no building block imports one.
const GENERATORS: &[&str] = &["sidecar", "router", "grpc"];

/// Each module under src/xds/generate (a file, or a directory with its files) and the sibling
/// modules it imports, outside tests; `generate` itself (the dispatcher) when a module imports
/// from it rather than from a sibling.
fn generator_imports() -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (parts, code) in sources("src/xds/generate") {
        if parts == ["mod.rs"] {
            continue;
        }
        let module = parts[0].trim_end_matches(".rs").to_string();
        // Where `super` points from this file: 1 = generate itself.
        let depth_to_generate = match parts.len() {
            1 => 1,
            _ if parts[1] == "mod.rs" => 1,
            _ => 2,
        };
        let imported = out.entry(module.clone()).or_default();
        for path in import_paths(&code) {
            let segments: Vec<&str> = path.split("::").collect();
            let rest = match segments.as_slice() {
                ["crate", "xds", "generate", rest @ ..] => rest,
                _ => {
                    let supers = segments.iter().take_while(|s| **s == "super").count();
                    if supers != depth_to_generate {
                        continue;
                    }
                    &segments[supers..]
                }
            };
            let Some(first) = rest.first() else { continue };
            let is_module = first.chars().all(|c| c.is_ascii_lowercase() || c == '_');
            let target = match is_module {
                true => first.to_string(),
                false => "generate".to_string(),
            };
            if target != module {
                imported.insert(target);
            }
        }
    }
    out
}

/// Every path a file names from `crate::` or `super::`, group imports (`super::{a, b::c}`)
/// expanded one level.
fn import_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for prefix in ["crate::", "super::"] {
        for (at, _) in code.match_indices(prefix) {
            if code[..at].ends_with("super::") || code[..at].ends_with("::") {
                continue;
            }
            let path: String = code[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let path = path.trim_end_matches(':').to_string();
            let after = &code[at + path.len()..];
            match after.strip_prefix("::{") {
                Some(group) => {
                    let group = group.split('}').next().unwrap_or_default();
                    for item in group.split(',') {
                        let item = item.trim().split("::").next().unwrap_or_default();
                        if !item.is_empty() {
                            out.push(format!("{path}::{item}"));
                        }
                    }
                }
                None => out.push(path),
            }
        }
    }
    out
}

#[test]
fn generators_import_no_generator_and_form_no_cycle() {
    let imports = generator_imports();
    let mut wrong = Vec::new();
    for (module, imported) in &imports {
        for target in imported {
            if target == "generate" {
                wrong.push(format!(
                    "generate/{module} imports from the dispatcher (generate/mod.rs): import the module that defines it"
                ));
            } else if GENERATORS.contains(&target.as_str()) {
                wrong.push(format!(
                    "generate/{module} imports the {target} generator: share a building block instead"
                ));
            }
        }
    }
    if let Some(cycle) = find_cycle(&imports) {
        wrong.push(format!("import cycle: {}", cycle.join(" → ")));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A path of imports returning to where it started, if the graph has one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_generator_check_sees_imports_and_cycles() {
    let imports = generator_imports();
    // Imports through groups, `super::` and `crate::xds::generate::` paths are all read.
    assert!(imports["router"].contains("clusters") && imports["router"].contains("filters"));
    assert!(imports["sidecar"].contains("routes"), "nested files read");
    assert!(imports["authz"].contains("names"), "crate paths read");
    let mut cyclic = imports.clone();
    cyclic
        .get_mut("filters")
        .expect("the filters block")
        .insert("router".to_string());
    assert!(find_cycle(&cyclic).is_some());
}
