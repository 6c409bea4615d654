//! YAML inputs: Kubernetes manifests (file clusters), Istio config (config files), mesh config,
//! meshNetworks and kubeconfigs (remote-cluster Secrets), each through the parser the binary uses.

use meshpilot::istio::{ConfigKind, ConfigObject, MeshConfig, Origin};
use meshpilot::kube_client::kubeconfig::{self, InsecureOptions};
use meshpilot::model::MeshNetworks;
use meshpilot::sources::{config_files, manifest};
use proptest::prelude::*;

use crate::mutate::{generated_text, mutated_bytes, mutated_json, mutated_text};
use crate::{bounded, clear_refusal, fuzz};

const MANIFESTS: &[&str] = &[
    include_str!("../../multicluster/examples/two-clusters/clusters/cluster1/reviews.yaml"),
    include_str!("../../multicluster/examples/two-clusters/clusters/cluster1/productpage.yaml"),
    include_str!("../../multicluster/examples/two-clusters/clusters/cluster1/nodes.yaml"),
    include_str!("../../multicluster/examples/two-clusters/clusters/cluster2/namespaces.yaml"),
    include_str!("../../multicluster/examples/multi-network/clusters/west1/mesh.yaml"),
    include_str!("../../deploy/eastwest-gateway.yaml"),
    "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Secret, metadata: {name: s, namespace: n}, data: {k: dmFsdWU=}}\n",
];

const ISTIO_CONFIG: &str = include_str!("corpus/istio-config.yaml");
const MESH_CONFIG: &str = include_str!("corpus/mesh-config.yaml");
const KUBECONFIG: &str = include_str!("corpus/kubeconfig.yaml");
const NETWORKS: &[&str] = &[
    include_str!("corpus/mesh-networks.yaml"),
    include_str!("../../multicluster/examples/multi-network/mesh-networks.yaml"),
];

/// Mutations per input: enough to break structure, few enough to keep most of it.
const MUTATIONS: usize = 6;

/// YAML whose aliases multiply: `levels` anchors, each a list of `fanout` aliases of the one before
/// (the first `width` scalars), as the value of `key` in a document starting with `head`.
fn alias_bomb(head: &'static str) -> impl Strategy<Value = String> {
    (1..6usize, 1..300usize, 1..300usize).prop_map(move |(levels, width, fanout)| {
        let mut out = format!("{head}bomb:\n  l0: &l0 [{}]\n", vec!["x"; width].join(","));
        for level in 1..levels {
            let previous = format!("*l{}", level - 1);
            let aliases = vec![previous.as_str(); fanout].join(",");
            out.push_str(&format!("  l{level}: &l{level} [{aliases}]\n"));
        }
        out
    })
}

/// Mutated seeds, generated text and alias bombs, in proportion.
fn inputs(seeds: &[&str], head: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![
        8 => mutated_text(seeds, MUTATIONS),
        1 => generated_text(),
        1 => alias_bomb(head),
    ]
}

fn documents_of(text: &str) -> Vec<&str> {
    text.split("\n---\n").collect()
}

/// Mutations start from inputs meshpilot accepts, or they would test only the first refusal.
#[test]
fn seeds_are_accepted() {
    for text in MANIFESTS {
        manifest::parse(text).expect("manifest seed");
    }
    let documents = config_files::documents(ISTIO_CONFIG).expect("Istio config seed");
    assert_eq!(documents.len(), documents_of(ISTIO_CONFIG).len());
    for value in &documents {
        let origin = Origin::File {
            path: "seed".into(),
            document: 1,
        };
        let parsed = ConfigObject::from_value(value, origin).expect("a kind meshpilot reads");
        parsed.expect("Istio config seed");
    }
    MeshConfig::parse(MESH_CONFIG, &MeshConfig::default()).expect("mesh config seed");
    for text in NETWORKS {
        MeshNetworks::parse(text).expect("meshNetworks seed");
    }
    let exec: InsecureOptions = "exec".parse().expect("option");
    kubeconfig::parse_untrusted(KUBECONFIG.as_bytes(), &exec).expect("kubeconfig seed");
}

#[test]
fn manifests() {
    let head = "apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n";
    fuzz("manifests", inputs(MANIFESTS, head), |text| {
        if let Err(e) = bounded(text.len(), || manifest::parse(&text))? {
            clear_refusal(&e, &["line ", "document "])?;
        }
        Ok(())
    });
}

#[test]
fn istio_config() {
    let mut seeds = documents_of(ISTIO_CONFIG);
    seeds.push(ISTIO_CONFIG);
    let head =
        "apiVersion: networking.istio.io/v1\nkind: Sidecar\nmetadata: {name: a, namespace: b}\n";
    let kinds: Vec<&str> = ConfigKind::ALL.iter().map(|k| k.name()).collect();
    fuzz("istio config", inputs(&seeds, head), |text| {
        let documents = match bounded(text.len(), || config_files::documents(&text))? {
            Ok(documents) => documents,
            Err((_, message)) => return clear_refusal(&message, &[]),
        };
        for (i, value) in documents.iter().enumerate() {
            let origin = Origin::File {
                path: "fuzz.yaml".into(),
                document: i + 1,
            };
            let parsed = bounded(text.len(), || ConfigObject::from_value(value, origin))?;
            if let Some(Err(e)) = parsed {
                clear_refusal(&e, &kinds)?;
            }
        }
        Ok(())
    });
}

/// Istio objects as the API server sends them (JSON), with fields replaced by generated values:
/// the validation rules, past the syntax.
#[test]
fn istio_config_fields() {
    let seeds = config_files::documents(ISTIO_CONFIG).expect("the seed config parses");
    let kinds: Vec<&str> = ConfigKind::ALL.iter().map(|k| k.name()).collect();
    fuzz("istio config fields", mutated_json(seeds, 4), |value| {
        let size = value.to_string().len();
        let origin = Origin::Kubernetes {
            cluster: "cluster1".into(),
            resource_version: "1".into(),
        };
        if let Some(Err(e)) = bounded(size, || ConfigObject::from_value(&value, origin))? {
            clear_refusal(&e, &kinds)?;
        }
        Ok(())
    });
}

#[test]
fn mesh_config() {
    let defaults = MeshConfig::default();
    fuzz("mesh config", inputs(&[MESH_CONFIG], ""), |text| {
        if let Err(e) = bounded(text.len(), || MeshConfig::parse(&text, &defaults))? {
            clear_refusal(&e, &[])?;
            prop_assert!(!e.field.is_empty(), "refusal names no field: {e}");
        }
        Ok(())
    });
}

#[test]
fn mesh_networks() {
    fuzz(
        "mesh networks",
        inputs(NETWORKS, "networks: {}\n"),
        |text| {
            if let Err(e) = bounded(text.len(), || MeshNetworks::parse(&text))? {
                clear_refusal(&e, &["mesh networks ", "network "])?;
            }
            Ok(())
        },
    );
}

#[test]
fn kubeconfigs() {
    let insecure = InsecureOptions::default();
    let head = "apiVersion: v1\nkind: Config\n";
    let inputs = prop_oneof![
        inputs(&[KUBECONFIG], head).prop_map(String::into_bytes),
        // Not only text: a Secret's bytes may be anything.
        mutated_bytes(vec![KUBECONFIG.as_bytes().to_vec()], MUTATIONS),
    ];
    fuzz("kubeconfigs", inputs, |bytes| {
        let parsed = bounded(bytes.len(), || {
            kubeconfig::parse_untrusted(&bytes, &insecure)
        })?;
        if let Err(e) = parsed {
            clear_refusal(&e, &["kubeconfig "])?;
        }
        Ok(())
    });
}
