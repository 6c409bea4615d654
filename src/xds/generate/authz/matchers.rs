//! Envoy matchers as istiod writes them for authorization: Istio's `*` wildcards (alone: present or
//! any, leading: suffix, trailing: prefix), JWT claims in jwt_authn's dynamic metadata, CIDRs.

use envoy_types::pb::envoy::config::core::v3::CidrRange;
use envoy_types::pb::envoy::config::route::v3::{header_matcher, HeaderMatcher};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    list_matcher, metadata_matcher, string_matcher, value_matcher, ListMatcher, MetadataMatcher,
    OrMatcher, RegexMatcher, StringMatcher, ValueMatcher,
};
use envoy_types::pb::google::protobuf::UInt32Value;

/// Where jwt_authn puts a verified token's payload.
pub const JWT_FILTER: &str = "envoy.filters.http.jwt_authn";
pub const JWT_PAYLOAD: &str = "payload";

fn string(pattern: string_matcher::MatchPattern, ignore_case: bool) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(pattern),
        ignore_case,
    }
}

pub fn exact(v: &str, ignore_case: bool) -> StringMatcher {
    string(string_matcher::MatchPattern::Exact(v.into()), ignore_case)
}

pub fn prefix(v: &str, ignore_case: bool) -> StringMatcher {
    string(string_matcher::MatchPattern::Prefix(v.into()), ignore_case)
}

pub fn suffix(v: &str, ignore_case: bool) -> StringMatcher {
    string(string_matcher::MatchPattern::Suffix(v.into()), ignore_case)
}

pub fn regex(re: &str) -> StringMatcher {
    string(
        string_matcher::MatchPattern::SafeRegex(RegexMatcher {
            regex: re.into(),
            ..Default::default()
        }),
        false,
    )
}

/// Any non-empty value.
pub fn any_value() -> StringMatcher {
    regex(".+")
}

/// Istio's value matcher with `*` wildcards, `prefix` put before the value (the `spiffe://` of
/// principals); `*` alone matches any non-empty value.
pub fn wildcard(v: &str, with_prefix: &str) -> StringMatcher {
    if v == "*" {
        any_value()
    } else if let Some(rest) = v.strip_prefix('*') {
        match with_prefix {
            "" => suffix(rest, false),
            p => regex(&format!("{p}.*{rest}")),
        }
    } else if let Some(rest) = v.strip_suffix('*') {
        prefix(&format!("{with_prefix}{rest}"), false)
    } else {
        exact(&format!("{with_prefix}{v}"), false)
    }
}

/// A header matcher with wildcards; `ignore_case` for hosts.
pub fn header(name: &str, v: &str, ignore_case: bool) -> HeaderMatcher {
    let specifier = if v == "*" {
        header_matcher::HeaderMatchSpecifier::PresentMatch(true)
    } else if let Some(rest) = v.strip_prefix('*') {
        header_matcher::HeaderMatchSpecifier::StringMatch(suffix(rest, ignore_case))
    } else if let Some(rest) = v.strip_suffix('*') {
        header_matcher::HeaderMatchSpecifier::StringMatch(prefix(rest, ignore_case))
    } else {
        header_matcher::HeaderMatchSpecifier::StringMatch(exact(v, ignore_case))
    };
    HeaderMatcher {
        name: name.into(),
        header_match_specifier: Some(specifier),
        ..Default::default()
    }
}

pub fn value(m: StringMatcher) -> ValueMatcher {
    ValueMatcher {
        match_pattern: Some(value_matcher::MatchPattern::StringMatch(m)),
    }
}

/// Any of the matchers (the only one, alone).
pub fn or_values(mut matchers: Vec<ValueMatcher>) -> ValueMatcher {
    match matchers.len() {
        1 => matchers.remove(0),
        _ => ValueMatcher {
            match_pattern: Some(value_matcher::MatchPattern::OrMatch(OrMatcher {
                value_matchers: matchers,
            })),
        },
    }
}

/// Any of `values` (with wildcards).
pub fn any_of(values: &[String]) -> ValueMatcher {
    or_values(values.iter().map(|v| value(wildcard(v, ""))).collect())
}

/// A list with an element `m` accepts.
pub fn list_with(m: ValueMatcher) -> ValueMatcher {
    ValueMatcher {
        match_pattern: Some(value_matcher::MatchPattern::ListMatch(Box::new(
            ListMatcher {
                match_pattern: Some(list_matcher::MatchPattern::OneOf(Box::new(m))),
            },
        ))),
    }
}

/// An element of a list, with wildcards.
pub fn element(v: &str) -> ValueMatcher {
    list_with(value(wildcard(v, "")))
}

/// Dynamic metadata of `filter` at `path`.
pub fn metadata(filter: &str, path: &[&str], value: ValueMatcher) -> MetadataMatcher {
    MetadataMatcher {
        filter: filter.into(),
        path: path
            .iter()
            .map(|key| metadata_matcher::PathSegment {
                segment: Some(metadata_matcher::path_segment::Segment::Key(
                    key.to_string(),
                )),
            })
            .collect(),
        value: Some(value),
        invert: false,
    }
}

/// A JWT claim (nested claims are a path) that is a string matching `m`.
pub fn claim(path: &[&str], m: StringMatcher) -> MetadataMatcher {
    let full: Vec<&str> = std::iter::once(JWT_PAYLOAD)
        .chain(path.iter().copied())
        .collect();
    metadata(JWT_FILTER, &full, value(m))
}

/// A JWT claim that is a list holding a value `m` accepts, or is such a value itself.
pub fn claim_list(path: &[&str], m: ValueMatcher) -> MetadataMatcher {
    let full: Vec<&str> = std::iter::once(JWT_PAYLOAD)
        .chain(path.iter().copied())
        .collect();
    metadata(JWT_FILTER, &full, or_values(vec![list_with(m.clone()), m]))
}

/// An address or CIDR (validated with the policy) as a range.
pub fn cidr(v: &str) -> Option<CidrRange> {
    let net: ipnet::IpNet = match v.contains('/') {
        true => v.parse().ok()?,
        false => ipnet::IpNet::from(v.parse::<std::net::IpAddr>().ok()?),
    };
    Some(CidrRange {
        address_prefix: net.network().to_string(),
        prefix_len: Some(UInt32Value {
            value: u32::from(net.prefix_len()),
        }),
    })
}
