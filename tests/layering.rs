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
    &["debug", "webhook", "install", "doctor"],
    // Entry points: the admin server, flags, the remote-secret tool.
    &["admin", "config", "remote_secret"],
    // Wiring.
    &["app"],
];

/// Each top-level module of src/ and the modules it imports (`crate::<module>`), outside tests.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.clone()];
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
            let relative = path.strip_prefix(&src).expect("below src");
            let first = relative.components().next().expect("a path");
            let module = first
                .as_os_str()
                .to_str()
                .expect("utf-8 name")
                .trim_end_matches(".rs")
                .to_string();
            if matches!(module.as_str(), "lib" | "main") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("readable source");
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
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
