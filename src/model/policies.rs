//! Security policy lookup: the PeerAuthentication, AuthorizationPolicies and RequestAuthentications
//! that apply to a workload (its namespace and labels), selected and composed as istiod does. Built
//! once per config version ([`ConfigStore::security`]) and read by the generators.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::config::ConfigStore;
use super::{Audience, Endpoint, TlsMode};
use crate::istio::security::authorization::{Action, AuthorizationPolicy};
use crate::istio::security::peer::{MtlsMode, PeerAuthentication};
use crate::istio::security::request::JwtRule;
use crate::istio::security::{applies_to, selects_workloads};
use crate::istio::{ConfigKey, ConfigKind, ConfigObject, Spec};

type Labels = BTreeMap<String, String>;

/// The policies of the mesh, by namespace, oldest first (istiod's order).
#[derive(Debug, Default)]
pub struct SecurityPolicies {
    root: Arc<str>,
    namespaces: BTreeMap<Arc<str>, Namespace>,
    /// Whether any PeerAuthentication says DISABLE (only then do clients' endpoints depend on them).
    any_disable: bool,
}

#[derive(Debug, Default)]
struct Namespace {
    peer: Vec<Arc<ConfigObject>>,
    authorization: Vec<Arc<ConfigObject>>,
    request: Vec<Arc<ConfigObject>>,
}

/// The effective mutual-TLS mode of a workload: one for the workload, maybe others per target port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MtlsSettings {
    pub mode: MtlsMode,
    pub ports: BTreeMap<u16, MtlsMode>,
}

impl MtlsSettings {
    pub fn for_port(&self, port: u16) -> MtlsMode {
        self.ports.get(&port).copied().unwrap_or(self.mode)
    }
}

/// An AuthorizationPolicy that applies, with its object (name, annotations).
pub type Selected<'a> = (&'a ConfigObject, &'a AuthorizationPolicy);

/// The AuthorizationPolicies of a workload by action, oldest first.
#[derive(Debug, Default)]
pub struct SelectedAuthorization<'a> {
    pub custom: Vec<Selected<'a>>,
    pub deny: Vec<Selected<'a>>,
    pub allow: Vec<Selected<'a>>,
    pub audit: Vec<Selected<'a>>,
}

/// Where a JWT rule's keys come from when they are not inline.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub enum JwksSource {
    /// `jwksUri`.
    Uri(String),
    /// OpenID discovery from the issuer (`<issuer>/.well-known/openid-configuration`).
    Issuer(String),
}

impl JwksSource {
    /// None for inline keys.
    pub fn of(rule: &JwtRule) -> Option<Self> {
        match (rule.jwks.is_empty(), rule.jwks_uri.is_empty()) {
            (false, _) => None,
            (true, false) => Some(Self::Uri(rule.jwks_uri.clone())),
            (true, true) => Some(Self::Issuer(rule.issuer.clone())),
        }
    }
}

/// Who uses a key source: the RequestAuthentications and the proxies that may see them.
#[derive(Clone, Debug, Default)]
pub struct JwksUse {
    pub policies: BTreeSet<ConfigKey>,
    pub audience: Audience,
}

impl SecurityPolicies {
    pub fn build(store: &ConfigStore) -> Self {
        let mut out = Self {
            root: store.mesh().root_namespace.as_str().into(),
            ..Self::default()
        };
        for kind in [
            ConfigKind::PeerAuthentication,
            ConfigKind::AuthorizationPolicy,
            ConfigKind::RequestAuthentication,
        ] {
            for object in store.of_kind(kind) {
                let ns = out
                    .namespaces
                    .entry(object.key.namespace.clone())
                    .or_default();
                let list = match &object.spec {
                    Spec::PeerAuthentication(pa) => {
                        out.any_disable |= pa.mentions_disable();
                        &mut ns.peer
                    }
                    Spec::AuthorizationPolicy(_) => &mut ns.authorization,
                    Spec::RequestAuthentication(_) => &mut ns.request,
                    _ => continue,
                };
                list.push(object.clone());
            }
        }
        for ns in out.namespaces.values_mut() {
            for list in [&mut ns.peer, &mut ns.authorization, &mut ns.request] {
                list.sort_by(|a, b| {
                    (a.meta.creation_timestamp.as_deref(), &a.key)
                        .cmp(&(b.meta.creation_timestamp.as_deref(), &b.key))
                });
            }
        }
        out
    }

    /// The policies of the root namespace and of `ns` (None for the root namespace itself).
    fn scopes(&self, ns: &str) -> (Option<&Namespace>, Option<&Namespace>) {
        let root = self.namespaces.get(&*self.root);
        let own = (ns != &*self.root)
            .then(|| self.namespaces.get(ns))
            .flatten();
        (root, own)
    }

    /// The workload's mode, as istiod composes it: the oldest mesh-wide (root namespace, no
    /// selector), namespace and workload (selector) policies, each inheriting where UNSET; port
    /// levels from the workload policy only; PERMISSIVE without any.
    pub fn mtls(&self, ns: &str, labels: &Labels) -> MtlsSettings {
        let (root, own) = self.scopes(ns);
        let mut settings = MtlsSettings {
            mode: MtlsMode::Permissive,
            ports: BTreeMap::new(),
        };
        let workload = oldest_peer(own, true, labels);
        for policy in [
            oldest_peer(root, false, labels),
            oldest_peer(own, false, labels),
            workload,
        ]
        .into_iter()
        .flatten()
        {
            match policy.mtls.map(|m| m.mode) {
                None | Some(MtlsMode::Unset) => {}
                Some(mode) => settings.mode = mode,
            }
        }
        if let Some(workload) = workload {
            settings.ports = workload
                .ports()
                .map(|(port, mode)| match mode {
                    MtlsMode::Unset => (port, settings.mode),
                    mode => (port, mode),
                })
                .collect();
        }
        settings
    }

    /// The mode clients infer for a namespace's services, as istiod's
    /// `BestEffortInferServiceMTLSMode` (pilot/pkg/model/push_context.go, through
    /// `GetNamespaceMutualTLSMode`): the namespace's oldest policy without a selector, else the
    /// mesh-wide one, each inheriting where UNSET; PERMISSIVE without any. Workload and port-level
    /// policies are not consulted.
    pub fn service_mtls(&self, ns: &str) -> MtlsMode {
        let (root, own) = self.scopes(ns);
        let nobody = Labels::default();
        let mut mode = MtlsMode::Permissive;
        for policy in [
            oldest_peer(root, false, &nobody),
            oldest_peer(own, false, &nobody),
        ]
        .into_iter()
        .flatten()
        {
            match policy.mtls.map(|m| m.mode) {
                None | Some(MtlsMode::Unset) => {}
                Some(set) => mode = set,
            }
        }
        mode
    }

    /// The TLS mode clients see for an endpoint: a workload whose policy disables mTLS on the
    /// endpoint's port gets plaintext, as istiod strips its `tlsMode` for auto mTLS.
    pub fn endpoint_tls(&self, ns: &str, endpoint: &Endpoint) -> TlsMode {
        let disabled = endpoint.tls_mode == TlsMode::Istio
            && self.any_disable
            && self.mtls(ns, &endpoint.labels).for_port(endpoint.port) == MtlsMode::Disable;
        match disabled {
            true => TlsMode::Disabled,
            false => endpoint.tls_mode,
        }
    }

    /// The AuthorizationPolicies of a workload, by action.
    pub fn authorization(&self, ns: &str, labels: &Labels) -> SelectedAuthorization<'_> {
        self.select_authorization(ns, labels, false)
    }

    /// The AuthorizationPolicies a waypoint enforces: those targeting its Gateway (istiod leaves
    /// namespace-wide and selector policies to ztunnel).
    pub fn waypoint_authorization(&self, ns: &str, labels: &Labels) -> SelectedAuthorization<'_> {
        self.select_authorization(ns, labels, true)
    }

    fn select_authorization(
        &self,
        ns: &str,
        labels: &Labels,
        targeted_only: bool,
    ) -> SelectedAuthorization<'_> {
        let mut out = SelectedAuthorization::default();
        let (root, own) = self.scopes(ns);
        for object in root.into_iter().chain(own).flat_map(|n| &n.authorization) {
            let Spec::AuthorizationPolicy(policy) = &object.spec else {
                continue;
            };
            let attachment = policy.attachment();
            if (targeted_only && !attachment.by_target())
                || !attachment.applies(&object.key.namespace, ns, labels)
            {
                continue;
            }
            let list = match policy.action {
                Action::Allow => &mut out.allow,
                Action::Deny => &mut out.deny,
                Action::Audit => &mut out.audit,
                Action::Custom => &mut out.custom,
            };
            list.push((object, policy));
        }
        out
    }

    /// The JWT rules of a workload, by issuer (istiod's order, for a stable filter).
    pub fn jwt_rules(&self, ns: &str, labels: &Labels) -> Vec<&JwtRule> {
        let (root, own) = self.scopes(ns);
        let mut rules: Vec<&JwtRule> = root
            .into_iter()
            .chain(own)
            .flat_map(|n| &n.request)
            .filter_map(|o| match &o.spec {
                Spec::RequestAuthentication(ra)
                    if ra.attachment().applies(&o.key.namespace, ns, labels) =>
                {
                    Some(&ra.jwt_rules)
                }
                _ => None,
            })
            .flatten()
            .collect();
        rules.sort_by(|a, b| a.issuer.cmp(&b.issuer));
        rules
    }

    /// Every key source the RequestAuthentications name, with who uses it.
    pub fn jwks_sources(&self) -> BTreeMap<JwksSource, JwksUse> {
        let mut out: BTreeMap<JwksSource, JwksUse> = BTreeMap::new();
        for (ns, policies) in &self.namespaces {
            for object in &policies.request {
                let Spec::RequestAuthentication(ra) = &object.spec else {
                    continue;
                };
                for source in ra.jwt_rules.iter().filter_map(JwksSource::of) {
                    let entry = out.entry(source).or_insert_with(|| JwksUse {
                        audience: Audience::Namespaces(BTreeSet::new()),
                        ..JwksUse::default()
                    });
                    entry.policies.insert(object.key.clone());
                    entry.audience = match (ns == &self.root, std::mem::take(&mut entry.audience)) {
                        (true, _) | (_, Audience::Everyone) => Audience::Everyone,
                        (false, Audience::Namespaces(mut set)) => {
                            set.insert(ns.clone());
                            Audience::Namespaces(set)
                        }
                    };
                }
            }
        }
        out
    }
}

/// The oldest namespace-wide (`workload` false) or selecting (`workload` true) PeerAuthentication
/// that applies to workloads with these labels.
fn oldest_peer<'a>(
    list: Option<&'a Namespace>,
    workload: bool,
    labels: &Labels,
) -> Option<&'a PeerAuthentication> {
    list?.peer.iter().find_map(|o| match &o.spec {
        Spec::PeerAuthentication(pa)
            if selects_workloads(&pa.selector) == workload && applies_to(&pa.selector, labels) =>
        {
            Some(pa)
        }
        _ => None,
    })
}

/// Whether a PeerAuthentication change may change what clients send (auto mTLS follows DISABLE):
/// only when this object or any other says DISABLE somewhere.
pub fn reaches_clients(store: &ConfigStore, object: &ConfigObject) -> bool {
    let disables =
        |o: &ConfigObject| matches!(&o.spec, Spec::PeerAuthentication(pa) if pa.mentions_disable());
    disables(object)
        || store
            .of_kind(ConfigKind::PeerAuthentication)
            .any(|o| disables(o))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::istio::test_object;
    use crate::model::ConfigChange;
    use crate::model::ConfigSource;

    fn object(
        kind: &str,
        ns: &str,
        name: &str,
        created: &str,
        spec: serde_json::Value,
    ) -> ConfigChange {
        ConfigChange::Upsert(test_object(kind, ns, name, created, spec))
    }

    fn labels(app: &str) -> Labels {
        Labels::from([("app".to_string(), app.to_string())])
    }

    #[test]
    fn peer_authentication_precedence_and_inheritance() {
        let mut store = ConfigStore::default();
        store.apply(
            ConfigSource::Files,
            vec![
                object(
                    "PeerAuthentication",
                    "istio-system",
                    "mesh",
                    "1",
                    serde_json::json!({"mtls": {"mode": "STRICT"}}),
                ),
                object(
                    "PeerAuthentication",
                    "shop",
                    "ns",
                    "1",
                    serde_json::json!({"mtls": {"mode": "UNSET"}}),
                ),
                object(
                    "PeerAuthentication",
                    "shop",
                    "web",
                    "1",
                    serde_json::json!({
                        "selector": {"matchLabels": {"app": "web"}},
                        "mtls": {"mode": "PERMISSIVE"},
                        "portLevelMtls": {"9000": {"mode": "DISABLE"}, "9001": {"mode": "UNSET"}}
                    }),
                ),
                object(
                    "PeerAuthentication",
                    "shop",
                    "web-newer",
                    "2",
                    serde_json::json!({
                        "selector": {"matchLabels": {"app": "web"}}, "mtls": {"mode": "DISABLE"}
                    }),
                ),
                object(
                    "PeerAuthentication",
                    "legacy",
                    "ns",
                    "1",
                    serde_json::json!({"mtls": {"mode": "DISABLE"}}),
                ),
            ],
        );
        let policies = store.security();
        let api = policies.mtls("shop", &labels("api"));
        assert_eq!(api.mode, MtlsMode::Strict, "UNSET inherits the mesh's");
        let web = policies.mtls("shop", &labels("web"));
        assert_eq!(
            web.mode,
            MtlsMode::Permissive,
            "the oldest workload policy wins"
        );
        assert_eq!(web.for_port(9000), MtlsMode::Disable);
        assert_eq!(
            web.for_port(9001),
            MtlsMode::Permissive,
            "UNSET port inherits the workload's"
        );
        assert_eq!(
            policies.mtls("legacy", &labels("x")).mode,
            MtlsMode::Disable
        );
        assert_eq!(policies.mtls("other", &labels("x")).mode, MtlsMode::Strict);
        assert_eq!(
            ConfigStore::default()
                .security()
                .mtls("x", &labels("x"))
                .mode,
            MtlsMode::Permissive
        );
    }

    #[test]
    fn authorization_and_jwt_selection() {
        let mut store = ConfigStore::default();
        store.apply(
            ConfigSource::Files,
            vec![
                object("AuthorizationPolicy", "istio-system", "mesh-deny", "1", serde_json::json!({"action": "DENY", "rules": [{}]})),
                object("AuthorizationPolicy", "shop", "allow-web", "1", serde_json::json!({"selector": {"matchLabels": {"app": "web"}}})),
                object("AuthorizationPolicy", "shop", "audit", "1", serde_json::json!({"action": "AUDIT", "rules": [{}]})),
                object("AuthorizationPolicy", "other", "allow", "1", serde_json::json!({})),
                object("RequestAuthentication", "shop", "jwt", "1", serde_json::json!({"jwtRules": [{"issuer": "b", "jwksUri": "https://b/keys"}, {"issuer": "a"}]})),
                object("RequestAuthentication", "istio-system", "jwt", "1", serde_json::json!({"jwtRules": [{"issuer": "c", "jwksUri": "https://b/keys"}]})),
            ],
        );
        let policies = store.security();
        let web = policies.authorization("shop", &labels("web"));
        assert_eq!(
            (web.deny.len(), web.allow.len(), web.audit.len()),
            (1, 1, 1)
        );
        let api = policies.authorization("shop", &labels("api"));
        assert!(api.allow.is_empty());
        let issuers: Vec<&str> = policies
            .jwt_rules("shop", &labels("x"))
            .iter()
            .map(|r| r.issuer.as_str())
            .collect();
        assert_eq!(issuers, ["a", "b", "c"]);
        let sources = policies.jwks_sources();
        assert_eq!(
            sources[&JwksSource::Uri("https://b/keys".into())].audience,
            Audience::Everyone
        );
        assert_eq!(
            sources[&JwksSource::Issuer("a".into())].audience,
            Audience::Namespaces(BTreeSet::from([Arc::from("shop")]))
        );
    }
}
