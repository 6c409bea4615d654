//! The kinds a manifest holds, as typed objects: k8s-openapi's for Kubernetes kinds (so a field the
//! schema does not have cannot be written), ours for Istio's. [`Object::parse`] reads a document
//! back and refuses one with fields its type does not have.

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::istio_objects::{Gateway, VirtualService};

/// One document of a manifest.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Object {
    Namespace(Box<Namespace>),
    ServiceAccount(Box<ServiceAccount>),
    ClusterRole(Box<ClusterRole>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
    Role(Box<Role>),
    RoleBinding(Box<RoleBinding>),
    ConfigMap(Box<ConfigMap>),
    CustomResourceDefinition(Box<CustomResourceDefinition>),
    Deployment(Box<Deployment>),
    PodDisruptionBudget(Box<PodDisruptionBudget>),
    Service(Box<Service>),
    EndpointSlice(Box<EndpointSlice>),
    MutatingWebhookConfiguration(Box<MutatingWebhookConfiguration>),
    ValidatingWebhookConfiguration(Box<ValidatingWebhookConfiguration>),
    Gateway(Box<Gateway>),
    VirtualService(Box<VirtualService>),
}

impl Object {
    /// Reads a document back as its typed object; refuses an unknown kind, a field of the wrong
    /// type, and any field the type does not have (naming it).
    pub fn parse(value: &Value) -> Result<Self, String> {
        let kind = value["kind"].as_str().unwrap_or_default();
        let name = value["metadata"]["name"].as_str().unwrap_or_default();
        let object = match kind {
            "Namespace" => Self::Namespace(Box::new(typed(value)?)),
            "ServiceAccount" => Self::ServiceAccount(Box::new(typed(value)?)),
            "ClusterRole" => Self::ClusterRole(Box::new(typed(value)?)),
            "ClusterRoleBinding" => Self::ClusterRoleBinding(Box::new(typed(value)?)),
            "Role" => Self::Role(Box::new(typed(value)?)),
            "RoleBinding" => Self::RoleBinding(Box::new(typed(value)?)),
            "ConfigMap" => Self::ConfigMap(Box::new(typed(value)?)),
            "CustomResourceDefinition" => Self::CustomResourceDefinition(Box::new(typed(value)?)),
            "Deployment" => Self::Deployment(Box::new(typed(value)?)),
            "PodDisruptionBudget" => Self::PodDisruptionBudget(Box::new(typed(value)?)),
            "Service" => Self::Service(Box::new(typed(value)?)),
            "EndpointSlice" => Self::EndpointSlice(Box::new(typed(value)?)),
            "MutatingWebhookConfiguration" => {
                Self::MutatingWebhookConfiguration(Box::new(typed(value)?))
            }
            "ValidatingWebhookConfiguration" => {
                Self::ValidatingWebhookConfiguration(Box::new(typed(value)?))
            }
            "Gateway" => Self::Gateway(Box::new(typed(value)?)),
            "VirtualService" => Self::VirtualService(Box::new(typed(value)?)),
            other => return Err(format!("{other} {name}: not a kind manifests hold")),
        };
        let again = serde_json::to_value(&object).map_err(|e| format!("{kind} {name}: {e}"))?;
        if &again != value {
            let unknown: Vec<String> = json_patch::diff(&again, value)
                .iter()
                .map(|op| serde_json::to_value(op).unwrap_or_default()["path"].to_string())
                .collect();
            return Err(format!(
                "{kind} {name}: fields its schema does not have (or not in its form): {}",
                unknown.join(", ")
            ));
        }
        Ok(object)
    }

    pub fn kind(&self) -> String {
        self.value()["kind"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    pub fn name(&self) -> String {
        self.value()["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// The object with one more label (an object of a named revision carries its name).
    pub fn labelled(self, key: &str, value: &str) -> Self {
        let mut json = self.value();
        json["metadata"]["labels"][key] = Value::String(value.to_string());
        // The same kind with one more string label always reads back.
        Self::parse(&json).unwrap_or(self)
    }

    fn value(&self) -> Value {
        serde_json::to_value(self).unwrap_or_default()
    }
}

fn typed<T: DeserializeOwned>(value: &Value) -> Result<T, String> {
    serde_path_to_error::deserialize(value.clone()).map_err(|e| {
        let kind = value["kind"].as_str().unwrap_or_default();
        let name = value["metadata"]["name"].as_str().unwrap_or_default();
        format!("{kind} {name}: {}: {}", e.path(), e.inner())
    })
}

macro_rules! from_typed {
    ($($variant:ident($ty:ty)),* $(,)?) => {$(
        impl From<$ty> for Object {
            fn from(object: $ty) -> Self {
                Self::$variant(Box::new(object))
            }
        }
    )*};
}

from_typed!(
    Namespace(Namespace),
    ServiceAccount(ServiceAccount),
    ClusterRole(ClusterRole),
    ClusterRoleBinding(ClusterRoleBinding),
    Role(Role),
    RoleBinding(RoleBinding),
    ConfigMap(ConfigMap),
    CustomResourceDefinition(CustomResourceDefinition),
    Deployment(Deployment),
    PodDisruptionBudget(PodDisruptionBudget),
    Service(Service),
    EndpointSlice(EndpointSlice),
    MutatingWebhookConfiguration(MutatingWebhookConfiguration),
    ValidatingWebhookConfiguration(ValidatingWebhookConfiguration),
    Gateway(Gateway),
    VirtualService(VirtualService),
);
