//! The mesh config as istiod reads it, every field: a mesh config holding every field of Istio's
//! MeshConfig and ProxyConfig (1.14 and today, tests/fixtures/mesh-config/every-field.yaml) starts
//! meshpilot, and each field is either applied (shown in force on /debug/mesh) or named under
//! `notApplied` with why — none dropped in silence. A misspelt field is logged with the name it
//! likely means, at start and on each change.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use common::*;
use meshpilot::istio::mesh_fields::{MESH_FIELDS, PROXY_FIELDS};
use serde_json::Value;

const EVERY_FIELD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/mesh-config/every-field.yaml"
);
const BOUND: Duration = Duration::from_secs(15);

fn keys(value: &Value) -> BTreeSet<String> {
    value.as_object().unwrap().keys().cloned().collect()
}

#[tokio::test]
async fn every_field_is_applied_or_reported_by_name() {
    let given: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(EVERY_FIELD).unwrap()).unwrap();
    // The fixture holds every field meshpilot knows of, at the top and in defaultConfig.
    let top = keys(&given);
    let proxy = keys(&given["defaultConfig"]);
    for (field, _) in MESH_FIELDS {
        assert!(top.contains(*field), "the fixture lacks {field}");
    }
    // serviceCluster and tracingServiceName are one proto oneof: a config holds one of them.
    fn one_of(field: &str) -> &str {
        match field {
            "tracingServiceName" => "serviceCluster",
            other => other,
        }
    }
    for (field, _) in PROXY_FIELDS {
        let field = one_of(field);
        assert!(
            proxy.contains(field),
            "the fixture lacks defaultConfig.{field}"
        );
    }

    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("clusters")).unwrap();
    let mp = start_meshpilot(dir.path(), &["--mesh-config", EVERY_FIELD]).await;
    let view = get_json(mp.http_addr, "/debug/mesh").await;
    let in_force = &view["meshConfig"];
    let reported: BTreeSet<String> = (view["notApplied"].as_array().unwrap().iter())
        .map(|n| {
            assert!(n["why"].as_str().is_some_and(|w| !w.is_empty()), "{n}");
            n["field"].as_str().unwrap().to_string()
        })
        .collect();
    for field in &top {
        let applied = in_force.get(field).is_some();
        assert!(
            applied != reported.contains(field),
            "{field}: applied {applied}, reported {}",
            reported.contains(field)
        );
    }
    for field in &proxy {
        let path = format!("defaultConfig.{field}");
        let applied = in_force["defaultConfig"].get(field).is_some();
        assert!(applied || reported.contains(&path), "{path}");
    }
    assert!(
        reported.contains("extensionProviders[1].lightstep"),
        "{reported:?}"
    );
    assert!(
        reported.contains("defaultConfig.tracing.customTags"),
        "{reported:?}"
    );
    // What is applied is in force: the connect timeout given, not Istio's 10 s.
    assert_eq!(in_force["connectTimeout"], "5s");
}

#[tokio::test]
async fn a_misspelt_field_is_logged_with_the_name_it_means() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("clusters")).unwrap();
    let mesh = dir.path().join("mesh.yaml");
    std::fs::write(&mesh, "trustDomian: example.org\n").unwrap();
    let config_dir = dir.path().to_str().unwrap();
    let process = MeshpilotProcess::discovery(
        &[
            "--config-dir",
            config_dir,
            "--mesh-config",
            mesh.to_str().unwrap(),
        ],
        &[],
    );
    let logged = |needle: &'static str| {
        let log = process.log();
        async move { log.contains(needle).then_some(()) }
    };
    wait_for("the misspelling at start", BOUND, || {
        logged("mesh config field trustDomian: unknown field: did you mean trustDomain?")
    })
    .await;
    let admin = process.bound_addr("admin").await;
    let view = get_json(admin, "/debug/mesh").await;
    assert_eq!(view["notApplied"][0]["field"], "trustDomian");
    assert_eq!(view["meshConfig"]["trustDomain"], "cluster.local");

    write_atomic(
        Path::new(&mesh),
        "defaultInboundHttpRetryPolicy: {attempts: 1}\n",
    );
    wait_for("the change", BOUND, || {
        logged("mesh config field defaultInboundHttpRetryPolicy: not applied")
    })
    .await;
}

/// docs/mesh-config.md lists every field with the treatment the code gives it.
#[test]
fn the_field_table_says_what_the_code_does() {
    use meshpilot::istio::mesh_fields::Treatment;
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/mesh-config.md"))
        .unwrap();
    let (mesh_part, proxy_part) = doc.split_once("## defaultConfig").unwrap();
    for (part, table) in [(mesh_part, MESH_FIELDS), (proxy_part, PROXY_FIELDS)] {
        let rows = part.lines().filter(|l| l.starts_with("| `")).count();
        assert_eq!(rows, table.len(), "one row per field");
        for (field, treatment) in table {
            let word = match treatment {
                Treatment::Applied => "applied",
                Treatment::NotApplied(_) => "not applied",
                Treatment::Unread(_) => "unread",
                Treatment::Removed => "removed",
            };
            let row = format!("| `{field}` | {word} |");
            assert!(part.contains(&row), "docs/mesh-config.md lacks {row}");
        }
    }
}
