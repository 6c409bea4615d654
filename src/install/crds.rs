//! The CustomResourceDefinitions of the Istio kinds the config store reads, from
//! [`ConfigKind::ALL`] (the Gateway API's CRDs are the API's own, installed by users as for
//! istiod): namespaced, every listed version served, the first one stored, schemas
//! that keep unknown fields (validation is the webhook's, with the store's rules).

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionNames, CustomResourceDefinitionSpec,
    CustomResourceDefinitionVersion, CustomResourceSubresourceStatus, CustomResourceSubresources,
    CustomResourceValidation, JSONSchemaProps,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::istio::ConfigKind;

pub fn all() -> Vec<CustomResourceDefinition> {
    ConfigKind::ALL
        .into_iter()
        .filter(|k| !k.is_gateway_api())
        .map(crd)
        .collect()
}

fn open_object() -> JSONSchemaProps {
    JSONSchemaProps {
        type_: Some("object".into()),
        x_kubernetes_preserve_unknown_fields: Some(true),
        ..Default::default()
    }
}

fn crd(kind: ConfigKind) -> CustomResourceDefinition {
    let schema = JSONSchemaProps {
        type_: Some("object".into()),
        properties: Some(BTreeMap::from([
            ("spec".to_string(), open_object()),
            ("status".to_string(), open_object()),
        ])),
        ..Default::default()
    };
    let versions = kind
        .versions()
        .iter()
        .enumerate()
        .map(|(i, version)| CustomResourceDefinitionVersion {
            name: version.to_string(),
            served: true,
            storage: i == 0,
            schema: Some(CustomResourceValidation {
                open_api_v3_schema: Some(schema.clone()),
            }),
            subresources: Some(CustomResourceSubresources {
                status: Some(CustomResourceSubresourceStatus(serde_json::json!({}))),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    let group_category = format!(
        "{}-istio-io",
        kind.group().split('.').next().unwrap_or_default()
    );
    CustomResourceDefinition {
        metadata: ObjectMeta {
            name: Some(format!("{}.{}", kind.plural(), kind.group())),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/part-of".to_string(),
                "meshpilot".to_string(),
            )])),
            ..Default::default()
        },
        spec: CustomResourceDefinitionSpec {
            group: kind.group().into(),
            names: CustomResourceDefinitionNames {
                kind: kind.name().into(),
                list_kind: Some(format!("{}List", kind.name())),
                plural: kind.plural().into(),
                singular: Some(kind.name().to_ascii_lowercase()),
                categories: Some(vec!["istio-io".into(), group_category]),
                ..Default::default()
            },
            scope: "Namespaced".into(),
            versions,
            ..Default::default()
        },
        status: None,
    }
}
