//! Which Ingresses are served, and by which gateways, from the mesh config: istiod's
//! `shouldProcessIngressWithClass` and `getIngressGatewaySelector`
//! (pilot/pkg/config/kube/ingress/virtualservices.go and gateways.go; the same in 1.14's
//! ingressv1/).

use crate::istio::mesh::IngressControllerMode;
use crate::istio::MeshConfig;

use super::api::{Ingress, IngressClass, CONTROLLER};

/// The mesh config's Ingress fields, with the namespace of the gateways serving Ingresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub mode: IngressControllerMode,
    /// `ingressClass`: the `kubernetes.io/ingress.class` value served.
    pub class: String,
    /// The `istio` label value selecting the gateways.
    pub gateway_label: String,
    /// `ingressService`: the Service whose addresses go into Ingresses' status ("": the
    /// gateways' nodes' external addresses).
    pub service: String,
    /// Where the Gateways made from Ingresses live, and the ingress Service (istiod's
    /// `K8S_INGRESS_NS`).
    pub namespace: String,
}

impl Settings {
    pub fn new(mesh: &MeshConfig, namespace: &str) -> Self {
        // An explicit selector; else the ingress Service's name, unless it is the default
        // install's, whose gateways are labelled `ingressgateway`.
        let gateway_label = match (&*mesh.ingress_selector, &*mesh.ingress_service) {
            (selector, _) if !selector.is_empty() => selector,
            (_, service) if !service.is_empty() && service != "istio-ingressgateway" => service,
            _ => "ingressgateway",
        };
        Self {
            mode: mesh.ingress_controller_mode,
            class: mesh.ingress_class.clone(),
            gateway_label: gateway_label.to_string(),
            service: mesh.ingress_service.clone(),
            namespace: namespace.to_string(),
        }
    }

    /// Whether Ingresses are served at all: not with mode OFF.
    pub fn enabled(&self) -> bool {
        self.mode != IngressControllerMode::Off
    }

    /// Whether an Ingress is served: its class annotation (whatever `spec.ingressClassName`
    /// says) must be `ingressClass`; else the IngressClass it names, if that exists, must be
    /// Istio's (whatever the mode); else it names no class, and DEFAULT serves it.
    /// `is-default-class` is not read, as in istiod: the API server's admission writes the
    /// default class into new Ingresses.
    pub fn serves(&self, ingress: &Ingress, class: Option<&IngressClass>) -> bool {
        use IngressControllerMode::{Default, Strict};
        match (&ingress.class_annotation, class) {
            (Some(annotated), _) => {
                matches!(self.mode, Strict | Default) && *annotated == self.class
            }
            (None, Some(class)) => class.controller == CONTROLLER,
            (None, None) => self.mode == Default,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ingress(annotation: Option<&str>) -> Ingress {
        Ingress {
            namespace: "shop".into(),
            name: "web".into(),
            labels: Default::default(),
            class_annotation: annotation.map(str::to_string),
            created: None,
            spec: Ok(Default::default()),
            status: Vec::new(),
        }
    }

    fn class(controller: &str) -> IngressClass {
        IngressClass {
            name: "c".into(),
            controller: controller.into(),
            parameters: false,
            default_class: false,
        }
    }

    fn settings(mode: IngressControllerMode) -> Settings {
        let mesh = MeshConfig {
            ingress_controller_mode: mode,
            ..MeshConfig::default()
        };
        Settings::new(&mesh, "istio-system")
    }

    #[test]
    fn the_annotation_then_the_class_then_the_mode_decide() {
        use IngressControllerMode::*;
        let (istio, nginx) = (class(CONTROLLER), class("k8s.io/ingress-nginx"));
        for mode in [Strict, Default] {
            let s = settings(mode);
            assert!(s.serves(&ingress(Some("istio")), Some(&nginx)), "{mode:?}");
            assert!(!s.serves(&ingress(Some("nginx")), Some(&istio)), "{mode:?}");
            assert!(s.serves(&ingress(None), Some(&istio)), "{mode:?}");
            assert!(!s.serves(&ingress(None), Some(&nginx)), "{mode:?}");
        }
        assert!(!settings(Strict).serves(&ingress(None), None));
        assert!(settings(Default).serves(&ingress(None), None));
        let off = settings(Off);
        assert!(!off.enabled() && !off.serves(&ingress(Some("istio")), None));
        assert!(!settings(Unspecified).serves(&ingress(Some("istio")), None));
    }

    #[test]
    fn gateways_are_selected_as_istiod_selects_them() {
        let label = |selector: &str, service: &str| {
            let mesh = MeshConfig {
                ingress_selector: selector.into(),
                ingress_service: service.into(),
                ..MeshConfig::default()
            };
            Settings::new(&mesh, "istio-system").gateway_label
        };
        assert_eq!(label("", "istio-ingressgateway"), "ingressgateway");
        assert_eq!(label("", ""), "ingressgateway");
        assert_eq!(label("", "edge"), "edge");
        assert_eq!(label("front", "edge"), "front");
    }
}
