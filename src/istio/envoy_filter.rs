//! EnvoyFilter (networking.istio.io/v1alpha3): patches to the Envoy configuration generated for the
//! workloads it selects, with Istio's rules (pkg/config/validation/envoyfilter) and then some: every
//! patch value is read against Envoy's API when the object is accepted, so a value Envoy's types do
//! not have (an unknown field, an unknown `@type`) is refused here instead of being dropped at push
//! time; and operations istiod would silently ignore for a target are refused.

use std::collections::BTreeMap;
use std::sync::Arc;

use prost_reflect::DynamicMessage;
use serde::{Deserialize, Serialize};

use super::security::{Attachment, PolicyTargetRef, WorkloadSelector};
use super::validate::{ensure, labels, Result, ValidationError};
use crate::envoy_api;
use crate::text::{clip, Quoted};

/// The HTTP connection manager's filter name: HTTP_FILTER patches apply inside it.
pub const HTTP_CONNECTION_MANAGER: &str = "envoy.filters.network.http_connection_manager";

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EnvoyFilter {
    pub workload_selector: Option<PatchSelector>,
    pub target_refs: Vec<PolicyTargetRef>,
    pub config_patches: Vec<ConfigPatch>,
    /// Lower first; then the root namespace's, then the oldest.
    pub priority: i32,
    /// `workloadSelector` in the form the other policies' attachment reads.
    #[serde(skip)]
    selector: Option<WorkloadSelector>,
}

/// EnvoyFilter's own selector form (`labels`, where the newer kinds say `matchLabels`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct PatchSelector {
    pub labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ConfigPatch {
    pub apply_to: ApplyTo,
    #[serde(rename = "match")]
    pub matches: Option<PatchMatch>,
    pub patch: Option<Patch>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ApplyTo {
    #[default]
    Invalid,
    Listener,
    FilterChain,
    NetworkFilter,
    HttpFilter,
    RouteConfiguration,
    VirtualHost,
    HttpRoute,
    Cluster,
    ExtensionConfig,
    Bootstrap,
    ListenerFilter,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Operation {
    #[default]
    Invalid,
    Merge,
    Add,
    Remove,
    InsertBefore,
    InsertAfter,
    InsertFirst,
    Replace,
    MergeAndReplaceList,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PatchContext {
    #[default]
    Any,
    SidecarInbound,
    SidecarOutbound,
    Gateway,
    Waypoint,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PatchMatch {
    pub context: PatchContext,
    pub proxy: Option<ProxyMatch>,
    pub listener: Option<ListenerMatch>,
    pub route_configuration: Option<RouteConfigurationMatch>,
    pub cluster: Option<ClusterMatch>,
    pub waypoint: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProxyMatch {
    /// A regular expression on the proxy's `ISTIO_VERSION` (unanchored, as Go's MatchString).
    pub proxy_version: String,
    /// String node metadata the proxy must carry, by key.
    pub metadata: BTreeMap<String, String>,
    #[serde(skip)]
    pub version: Option<VersionRegex>,
}

/// A compiled `proxyVersion`; equal when their patterns are.
#[derive(Clone, Debug)]
pub struct VersionRegex(pub regex::Regex);

impl PartialEq for VersionRegex {
    fn eq(&self, other: &Self) -> bool {
        self.0.as_str() == other.0.as_str()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ListenerMatch {
    pub port_number: u32,
    pub port_name: String,
    pub filter_chain: Option<FilterChainMatch>,
    pub listener_filter: String,
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FilterChainMatch {
    pub name: String,
    pub sni: String,
    pub transport_protocol: String,
    /// Comma-separated; every one must be among the chain's.
    pub application_protocols: String,
    pub filter: Option<FilterMatch>,
    pub destination_port: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FilterMatch {
    pub name: String,
    pub sub_filter: Option<SubFilterMatch>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct SubFilterMatch {
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RouteConfigurationMatch {
    pub port_number: u32,
    pub port_name: String,
    /// `<namespace>/<name>` of an Istio Gateway, for gateways' route configurations.
    pub gateway: String,
    pub vhost: Option<VirtualHostMatch>,
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct VirtualHostMatch {
    pub name: String,
    pub route: Option<RouteMatch>,
    pub domain_name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct RouteMatch {
    pub name: String,
    pub action: RouteAction,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RouteAction {
    #[default]
    Any,
    Route,
    Redirect,
    DirectResponse,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ClusterMatch {
    pub port_number: u32,
    pub service: String,
    pub subset: String,
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Patch {
    pub operation: Operation,
    pub value: Option<serde_json::Value>,
    pub filter_class: FilterClass,
    /// `value` read as the Envoy message `applyTo` names.
    #[serde(skip)]
    pub message: Option<PatchValue>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum FilterClass {
    #[default]
    Unspecified,
    Authn,
    Authz,
    Stats,
}

/// A patch value as an Envoy message. Always equal: it is derived from `value`, which the
/// patch's own equality compares (two readings of one JSON may differ in their map order).
#[derive(Clone)]
pub struct PatchValue(pub Arc<DynamicMessage>);

/// Its type only: a message's descriptor prints without end where types nest (`Struct`).
impl std::fmt::Debug for PatchValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use prost_reflect::ReflectMessage;
        write!(f, "PatchValue({})", self.0.descriptor().full_name())
    }
}

impl PartialEq for PatchValue {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl ApplyTo {
    /// The Envoy message a patch value of this target is.
    pub fn message_type(self) -> Option<&'static str> {
        Some(match self {
            Self::Listener => "envoy.config.listener.v3.Listener",
            Self::FilterChain => "envoy.config.listener.v3.FilterChain",
            Self::NetworkFilter => "envoy.config.listener.v3.Filter",
            Self::HttpFilter => {
                "envoy.extensions.filters.network.http_connection_manager.v3.HttpFilter"
            }
            Self::RouteConfiguration => "envoy.config.route.v3.RouteConfiguration",
            Self::VirtualHost => "envoy.config.route.v3.VirtualHost",
            Self::HttpRoute => "envoy.config.route.v3.Route",
            Self::Cluster => "envoy.config.cluster.v3.Cluster",
            Self::ExtensionConfig => "envoy.config.core.v3.TypedExtensionConfig",
            Self::ListenerFilter => "envoy.config.listener.v3.ListenerFilter",
            Self::Invalid | Self::Bootstrap => return None,
        })
    }

    /// The operations that do something to this target. Those istiod turns into ADD (INSERT_* on
    /// targets without an order of their own) are read as ADD by [`Patch::effective_operation`].
    fn supports(self, op: Operation) -> bool {
        use Operation::*;
        match self {
            Self::Listener | Self::FilterChain | Self::Cluster => {
                matches!(op, Merge | MergeAndReplaceList | Add | Remove) || op.inserts()
            }
            Self::ListenerFilter => !matches!(op, MergeAndReplaceList | Invalid),
            Self::NetworkFilter | Self::HttpFilter => !matches!(op, MergeAndReplaceList | Invalid),
            Self::RouteConfiguration => matches!(op, Merge | MergeAndReplaceList),
            Self::VirtualHost => {
                matches!(op, Merge | MergeAndReplaceList | Add | Remove | Replace) || op.inserts()
            }
            Self::HttpRoute => !matches!(op, Replace | Invalid),
            Self::ExtensionConfig => op == Add || op.inserts(),
            Self::Invalid | Self::Bootstrap => false,
        }
    }

    /// Targets kept in an order of their own, where INSERT_* means a place in it.
    fn ordered(self) -> bool {
        matches!(
            self,
            Self::ListenerFilter | Self::NetworkFilter | Self::HttpFilter | Self::HttpRoute
        )
    }
}

impl Operation {
    fn inserts(self) -> bool {
        matches!(
            self,
            Self::InsertBefore | Self::InsertAfter | Self::InsertFirst
        )
    }

    pub fn merges(self) -> bool {
        matches!(self, Self::Merge | Self::MergeAndReplaceList)
    }
}

impl ConfigPatch {
    /// The operation as applied: INSERT_* on a target without an order is ADD, as in istiod
    /// (`convertToEnvoyFilterWrapper`, pilot/pkg/model/envoyfilter.go).
    pub fn effective_operation(&self) -> Operation {
        let op = self.patch.as_ref().map(|p| p.operation).unwrap_or_default();
        match op.inserts() && !self.apply_to.ordered() {
            true => Operation::Add,
            false => op,
        }
    }

    /// The patch value as an Envoy message (None for REMOVE).
    pub fn value(&self) -> Option<&Arc<DynamicMessage>> {
        self.patch.as_ref()?.message.as_ref().map(|v| &v.0)
    }

    pub fn context(&self) -> PatchContext {
        self.matches.as_ref().map(|m| m.context).unwrap_or_default()
    }
}

impl EnvoyFilter {
    /// How it attaches: by `workloadSelector` (none: its whole namespace, or every namespace from
    /// the root namespace) or by `targetRefs` to a Gateway API Gateway.
    pub fn attachment(&self) -> Attachment<'_> {
        Attachment {
            selector: &self.selector,
            target_ref: &None,
            target_refs: &self.target_refs,
        }
    }

    /// Validates the object and reads each patch value against Envoy's API.
    pub fn compile(&mut self) -> Result {
        if let Some(selector) = &self.workload_selector {
            labels("workloadSelector.labels", &selector.labels)?;
            self.selector = Some(WorkloadSelector {
                match_labels: selector.labels.clone(),
            });
        }
        self.attachment().validate()?;
        for (i, patch) in self.config_patches.iter_mut().enumerate() {
            patch
                .compile()
                .map_err(|e| e.under(&format!("configPatches[{i}]")))?;
        }
        Ok(())
    }
}

impl ConfigPatch {
    fn compile(&mut self) -> Result {
        let apply_to = self.apply_to;
        ensure(apply_to != ApplyTo::Invalid, "applyTo", "missing applyTo")?;
        ensure(
            apply_to != ApplyTo::Bootstrap,
            "applyTo",
            "BOOTSTRAP is not implemented: meshpilot serves no bootstrap (Istio's agent writes it)",
        )?;
        if let Some(matches) = &mut self.matches {
            matches.compile(apply_to).map_err(|e| e.under("match"))?;
        }
        let Some(patch) = &mut self.patch else {
            return Err(ValidationError::at("patch", "missing patch"));
        };
        let op = patch.operation;
        ensure(
            op != Operation::Invalid,
            "patch.operation",
            "missing patch operation",
        )?;
        ensure(
            apply_to.supports(op),
            "patch.operation",
            format!(
                "{} does nothing to a {} (istiod would ignore it)",
                api_name(&op),
                api_name(&apply_to)
            ),
        )?;
        ensure(
            patch.filter_class == FilterClass::Unspecified,
            "patch.filterClass",
            "is a deprecated Istio field meshpilot does not implement (use INSERT_BEFORE or INSERT_AFTER)",
        )?;
        match (&patch.value, op) {
            (Some(_), Operation::Remove) => {
                return Err(ValidationError::at("patch.value", "REMOVE takes no value"))
            }
            (None, Operation::Remove) => {}
            (None, _) => {
                return Err(ValidationError::at(
                    "patch.value",
                    "missing patch value for non-remove operation",
                ))
            }
            (Some(value), _) => {
                let ty = apply_to.message_type().unwrap_or_default();
                let message = envoy_api::from_json(ty, value)
                    .map_err(|e| ValidationError::at("patch.value", clip(&e.to_string())))?;
                patch.message = Some(PatchValue(Arc::new(message)));
            }
        }
        let matches = self.matches.as_ref();
        let filter = matches
            .and_then(|m| m.listener.as_ref())
            .and_then(|l| l.filter_chain.as_ref())
            .and_then(|c| c.filter.as_ref());
        let named_filter = match apply_to {
            ApplyTo::NetworkFilter => filter.is_some_and(|f| !f.name.is_empty()),
            ApplyTo::HttpFilter => filter
                .and_then(|f| f.sub_filter.as_ref())
                .is_some_and(|s| !s.name.is_empty()),
            ApplyTo::ListenerFilter => matches
                .and_then(|m| m.listener.as_ref())
                .is_some_and(|l| !l.listener_filter.is_empty()),
            _ => true,
        };
        let needs_name = matches!(op, Operation::Replace | Operation::Remove)
            || (op.merges() && apply_to == ApplyTo::HttpFilter);
        ensure(
            !needs_name || named_filter,
            "match.listener",
            format!(
                "{} of a {} names the filter it applies to",
                api_name(&op),
                api_name(&apply_to)
            ),
        )
    }
}

impl PatchMatch {
    fn compile(&mut self, apply_to: ApplyTo) -> Result {
        ensure(
            self.context != PatchContext::Waypoint && self.waypoint.is_none(),
            "context",
            "WAYPOINT is not implemented: meshpilot serves no ambient waypoints",
        )?;
        if let Some(proxy) = &mut self.proxy {
            if !proxy.proxy_version.is_empty() {
                let regex = regex::RegexBuilder::new(&proxy.proxy_version)
                    .size_limit(1 << 16)
                    .build()
                    .map_err(|e| {
                        ValidationError::at(
                            "proxy.proxyVersion",
                            format!("invalid regex for proxy version: {}", clip(&e.to_string())),
                        )
                    })?;
                proxy.version = Some(VersionRegex(regex));
            }
        }
        let allowed = match apply_to {
            ApplyTo::Listener
            | ApplyTo::FilterChain
            | ApplyTo::NetworkFilter
            | ApplyTo::HttpFilter
            | ApplyTo::ListenerFilter => "listener",
            ApplyTo::RouteConfiguration | ApplyTo::VirtualHost | ApplyTo::HttpRoute => {
                "routeConfiguration"
            }
            ApplyTo::Cluster => "cluster",
            _ => "",
        };
        for (name, set) in [
            ("listener", self.listener.is_some()),
            ("routeConfiguration", self.route_configuration.is_some()),
            ("cluster", self.cluster.is_some()),
        ] {
            ensure(
                !set || name == allowed,
                name,
                format!("{} patches cannot match on a {name}", api_name(&apply_to)),
            )?;
        }
        if let Some(listener) = &self.listener {
            listener
                .validate(apply_to)
                .map_err(|e| e.under("listener"))?;
        }
        if let Some(route) = &self.route_configuration {
            ensure(
                route.port_name.is_empty() || route.gateway.is_empty() || route.port_number != 0,
                "routeConfiguration.portName",
                "a gateway's route configuration is matched by portNumber with portName",
            )?;
        }
        Ok(())
    }
}

impl ListenerMatch {
    fn validate(&self, apply_to: ApplyTo) -> Result {
        ensure(
            self.port_name.is_empty(),
            "portName",
            "is an Istio field Istio itself does not implement (match portNumber)",
        )?;
        deprecated_name("listenerFilter", &self.listener_filter)?;
        let Some(filter) = self.filter_chain.as_ref().and_then(|c| c.filter.as_ref()) else {
            return Ok(());
        };
        ensure(
            !filter.name.is_empty(),
            "filterChain.filter.name",
            "a filter match names the filter",
        )?;
        deprecated_name("filterChain.filter.name", &filter.name)?;
        ensure(
            matches!(apply_to, ApplyTo::NetworkFilter | ApplyTo::HttpFilter),
            "filterChain.filter",
            "a filter match has no effect on this target",
        )?;
        if let Some(sub) = &filter.sub_filter {
            ensure(
                apply_to == ApplyTo::HttpFilter,
                "filterChain.filter.subFilter",
                "subFilter is only for HTTP_FILTER patches",
            )?;
            ensure(
                filter.name == HTTP_CONNECTION_MANAGER,
                "filterChain.filter.name",
                format!("HTTP filters live in {HTTP_CONNECTION_MANAGER}"),
            )?;
            ensure(
                !sub.name.is_empty(),
                "filterChain.filter.subFilter.name",
                "a subFilter match names the filter",
            )?;
            deprecated_name("filterChain.filter.subFilter.name", &sub.name)?;
        }
        Ok(())
    }
}

/// An enum value as the API spells it (`INSERT_BEFORE`).
pub fn api_name<T: Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(name)) => name,
        _ => String::new(),
    }
}

/// Envoy's pre-1.14 filter names (`envoy.router`, `envoy.http_connection_manager`,
/// `envoy.listener.tls_inspector`): Envoy no longer knows them and istiod matches filters by exact
/// name, so such a match would never apply.
fn deprecated_name(field: &str, name: &str) -> Result {
    let old = name
        .strip_prefix("envoy.")
        .is_some_and(|rest| !rest.contains('.') || rest.starts_with("listener."));
    ensure(
        !old,
        field,
        format!(
            "{} is a deprecated Envoy filter name that matches nothing: use its envoy.filters.<kind>.<name> form",
            Quoted(name)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compiled(yaml: &str) -> std::result::Result<EnvoyFilter, ValidationError> {
        let value: serde_json::Value = serde_yaml_ng::from_str(yaml).unwrap();
        let mut filter: EnvoyFilter = serde_json::from_value(value).unwrap();
        filter.compile().map(|()| filter)
    }

    #[test]
    fn a_lua_filter_before_the_router_reads_against_envoys_api() {
        let filter = compiled(
            "
configPatches:
- applyTo: HTTP_FILTER
  match:
    context: SIDECAR_INBOUND
    listener:
      filterChain:
        filter:
          name: envoy.filters.network.http_connection_manager
          subFilter: {name: envoy.filters.http.router}
  patch:
    operation: INSERT_BEFORE
    value:
      name: envoy.lua
      typed_config:
        '@type': type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
        defaultSourceCode: {inlineString: 'function envoy_on_response(h) h:headers():add(\"x-lua\", \"1\") end'}
",
        )
        .expect("valid");
        let patch = &filter.config_patches[0];
        assert_eq!(patch.effective_operation(), Operation::InsertBefore);
        assert!(patch.value().is_some());
    }

    #[test]
    fn refusals_name_the_field() {
        let cases = [
            ("configPatches: [{applyTo: CLUSTER, patch: {operation: MERGE, value: {connect_timout: 1s}}}]", "configPatches[0].patch.value"),
            ("configPatches: [{applyTo: CLUSTER, patch: {operation: MERGE}}]", "configPatches[0].patch.value"),
            ("configPatches: [{applyTo: CLUSTER, patch: {operation: REPLACE, value: {}}}]", "configPatches[0].patch.operation"),
            ("configPatches: [{applyTo: ROUTE_CONFIGURATION, patch: {operation: ADD, value: {}}}]", "configPatches[0].patch.operation"),
            ("configPatches: [{applyTo: CLUSTER, match: {listener: {}}, patch: {operation: REMOVE}}]", "configPatches[0].match.listener"),
            ("configPatches: [{applyTo: NETWORK_FILTER, match: {proxy: {proxyVersion: '^1\\.(2'}}, patch: {operation: REMOVE}}]", "configPatches[0].match.proxy.proxyVersion"),
            ("configPatches: [{applyTo: NETWORK_FILTER, match: {listener: {filterChain: {filter: {name: envoy.http_connection_manager}}}}, patch: {operation: REMOVE}}]", "configPatches[0].match.listener.filterChain.filter.name"),
            ("configPatches: [{applyTo: HTTP_FILTER, patch: {operation: REMOVE}}]", "configPatches[0].match.listener"),
            ("configPatches: [{applyTo: BOOTSTRAP, patch: {operation: MERGE, value: {}}}]", "configPatches[0].applyTo"),
            ("configPatches: [{applyTo: LISTENER, patch: {operation: ADD}}]", "configPatches[0].patch.value"),
            ("workloadSelector: {labels: {'a b': c}}", "workloadSelector.labels"),
        ];
        for (yaml, field) in cases {
            let error = compiled(yaml).expect_err(yaml);
            assert_eq!(error.field, field, "{yaml}: {error}");
        }
    }

    #[test]
    fn inserts_without_an_order_are_adds_as_in_istiod() {
        let filter = compiled(
            "configPatches: [{applyTo: CLUSTER, patch: {operation: INSERT_BEFORE, value: {name: extra}}}]",
        )
        .unwrap();
        assert_eq!(
            filter.config_patches[0].effective_operation(),
            Operation::Add
        );
    }
}
