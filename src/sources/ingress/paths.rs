//! An Ingress path as a VirtualService `uri` match, and the order istiod gives an Ingress host's
//! routes (pilot/pkg/config/kube/ingress/virtualservices.go `createFallbackStringMatch`,
//! `sortHTTPRoutes`; 1.14's ingressv1/conversion.go).

use super::api::HttpPath;

/// A route's path match: the VirtualService `uri`, or none (any path).
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Uri {
    Exact(String),
    Prefix(String),
}

/// How a path matches: Exact and Prefix as written; ImplementationSpecific (or none) as istiod's
/// `createFallbackStringMatch`: any path for "", `*`, `/*` and `.*`, a prefix for one ending in
/// `/*` or `.*`, else exact. Regular expressions are refused rather than matched literally.
pub(super) fn uri(path: &HttpPath) -> Result<Option<Uri>, String> {
    let p = path.path.as_str();
    let kind = (path.path_type.as_deref()).unwrap_or("ImplementationSpecific");
    let any = ["", "*", "/*", ".*"];
    if kind == "ImplementationSpecific" && any.contains(&p) {
        return Ok(None);
    }
    if !p.starts_with('/') {
        return Err(format!("{p:?} is not an absolute path"));
    }
    if p.contains(['?', '#']) {
        return Err(format!(
            "{p:?} holds a query or fragment, which no path has"
        ));
    }
    match kind {
        "Exact" => Ok(Some(Uri::Exact(p.into()))),
        "Prefix" => Ok(Some(Uri::Prefix(p.into()))),
        "ImplementationSpecific" => {
            let (rest, prefix) = match p.strip_suffix(".*").or_else(|| p.strip_suffix("/*")) {
                Some(rest) => (rest, true),
                None => (p, false),
            };
            if rest.contains(['*', '[', ']', '(', ')', '|', '^', '$', '\\', '{', '}']) {
                return Err(format!(
                    "{p:?} reads as a regular expression, which is not supported: an \
                     ImplementationSpecific path is exact, or a prefix when it ends in /* or .*"
                ));
            }
            Ok(Some(match prefix {
                true => Uri::Prefix(rest.into()),
                false => Uri::Exact(rest.into()),
            }))
        }
        other => Err(format!(
            "pathType {other:?} is not Exact, Prefix or ImplementationSpecific"
        )),
    }
}

/// istiod's order key (`sortHTTPRoutes`): the matched string's length, longest first, then Exact
/// first; a route matching any path has length 0.
pub(super) fn rank(uri: &Option<Uri>) -> (std::cmp::Reverse<usize>, bool) {
    let (len, exact) = match uri {
        Some(Uri::Exact(p)) => (p.len(), true),
        Some(Uri::Prefix(p)) => (p.len(), false),
        None => (0, false),
    };
    (std::cmp::Reverse(len), !exact)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(path: &str, kind: Option<&str>) -> Result<Option<Uri>, String> {
        uri(&HttpPath {
            path: path.into(),
            path_type: kind.map(str::to_string),
            ..Default::default()
        })
    }

    #[test]
    fn implementation_specific_paths_read_as_istiod_reads_them() {
        let specific = Some("ImplementationSpecific");
        for any in ["", "*", "/*", ".*"] {
            assert_eq!(path(any, specific), Ok(None), "{any:?}");
            assert_eq!(path(any, None), Ok(None), "{any:?} without a type");
        }
        let prefix = |p: &str| Ok(Some(Uri::Prefix(p.into())));
        assert_eq!(path("/static/*", specific), prefix("/static"));
        assert_eq!(path("/v1.*", specific), prefix("/v1"));
        assert_eq!(
            path("/login", specific),
            Ok(Some(Uri::Exact("/login".into())))
        );
        let refused = path("/v[0-9]+", specific).unwrap_err();
        assert!(refused.contains("regular expression"), "{refused}");
        assert!(path("/a/*/b", specific).is_err());
    }

    #[test]
    fn exact_and_prefix_are_as_written_and_must_be_paths() {
        assert_eq!(path("/a", Some("Exact")), Ok(Some(Uri::Exact("/a".into()))));
        assert_eq!(
            path("/a/", Some("Prefix")),
            Ok(Some(Uri::Prefix("/a/".into())))
        );
        assert!(path("a", Some("Prefix"))
            .unwrap_err()
            .contains("not an absolute path"));
        assert!(path("/a?b", Some("Exact")).is_err());
        assert!(path("/a", Some("Regex")).unwrap_err().contains("\"Regex\""));
    }

    #[test]
    fn longer_paths_first_then_exact_then_any() {
        let mut uris = vec![
            None,
            Some(Uri::Prefix("/api".into())),
            Some(Uri::Exact("/api".into())),
            Some(Uri::Prefix("/api/login".into())),
        ];
        uris.sort_by_key(rank);
        assert_eq!(
            uris,
            [
                Some(Uri::Prefix("/api/login".into())),
                Some(Uri::Exact("/api".into())),
                Some(Uri::Prefix("/api".into())),
                None,
            ]
        );
    }
}
