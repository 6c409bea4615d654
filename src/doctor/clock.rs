//! Clock skew: an API server's `Date` header against the local clock. Workload certificates are
//! valid from the moment they are signed; a cluster whose clock is far behind sees them as not yet
//! valid, one far ahead sees them expire early.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use time::{Date, Month, PrimitiveDateTime, Time};

use super::report::Check;
use crate::text::quote;

const NAME: &str = "clock";

/// An HTTP date in the form servers must send (IMF-fixdate: `Sun, 06 Nov 1994 08:49:37 GMT`).
pub fn parse_http_date(text: &str) -> Option<SystemTime> {
    let parts: Vec<&str> = text.split_whitespace().collect();
    let [_weekday, day, month, year, clock, "GMT"] = parts.as_slice() else {
        return None;
    };
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let month = MONTHS.iter().position(|m| m == month)?;
    let month = Month::try_from(u8::try_from(month + 1).ok()?).ok()?;
    let date = Date::from_calendar_date(year.parse().ok()?, month, day.parse().ok()?).ok()?;
    let mut hms = clock.split(':').map(str::parse::<u8>);
    let (Some(Ok(h)), Some(Ok(m)), Some(Ok(s)), None) =
        (hms.next(), hms.next(), hms.next(), hms.next())
    else {
        return None;
    };
    let at = PrimitiveDateTime::new(date, Time::from_hms(h, m, s).ok()?).assume_utc();
    let secs = u64::try_from(at.unix_timestamp()).ok()?;
    Some(UNIX_EPOCH + Duration::from_secs(secs))
}

/// Whether the server's clock (its `Date` header, received at `local`) is within `bound` of ours.
pub fn check(date: Option<&str>, local: SystemTime, bound: Duration) -> Check {
    let Some(text) = date else {
        return Check::warn(NAME, "the API server sent no Date header; skew not checked");
    };
    let Some(remote) = parse_http_date(text) else {
        return Check::warn(
            NAME,
            format!(
                "the API server's Date header {} is not an HTTP date; skew not checked",
                quote(text)
            ),
        );
    };
    let (skew, direction) = match remote.duration_since(local) {
        Ok(ahead) => (ahead, "ahead of"),
        Err(behind) => (behind.duration(), "behind"),
    };
    // The header has whole seconds: anything under two is noise.
    let shown = humantime::format_duration(Duration::from_secs(skew.as_secs()));
    if skew > bound {
        Check::fail(
            NAME,
            format!(
                "the API server's clock is {shown} {direction} this machine's, more than {}: certificates would be refused as not yet valid or expired",
                humantime::format_duration(bound)
            ),
        )
    } else if skew < Duration::from_secs(2) {
        Check::ok(NAME, "in step with this machine's")
    } else {
        Check::ok(NAME, format!("{shown} {direction} this machine's"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::report::Status;

    #[test]
    fn parses_imf_fixdate_only() {
        let parsed = parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(parsed, UNIX_EPOCH + Duration::from_secs(784_111_777));
        assert_eq!(parse_http_date("Sunday, 06-Nov-94 08:49:37 GMT"), None);
        assert_eq!(parse_http_date("Sun, 06 Nov 1994 08:49:37 CET"), None);
        assert_eq!(parse_http_date("Sun, 31 Feb 1994 08:49:37 GMT"), None);
        assert_eq!(parse_http_date("Sun, 06 Nov 1994 08:49 GMT"), None);
        assert_eq!(parse_http_date(""), None);
    }

    #[test]
    fn skew_beyond_the_bound_fails_either_way() {
        let local = UNIX_EPOCH + Duration::from_secs(784_111_777);
        let bound = Duration::from_secs(300);
        let header = |offset: i64| {
            let t = time::OffsetDateTime::from_unix_timestamp(784_111_777 + offset).unwrap();
            let month = &t.month().to_string()[..3];
            format!(
                "Mon, {:02} {month} {} {:02}:{:02}:{:02} GMT",
                t.day(),
                t.year(),
                t.hour(),
                t.minute(),
                t.second()
            )
        };
        assert_eq!(check(Some(&header(0)), local, bound).status, Status::Ok);
        assert_eq!(check(Some(&header(-299)), local, bound).status, Status::Ok);
        let ahead = check(Some(&header(600)), local, bound);
        assert_eq!(ahead.status, Status::Fail);
        assert!(ahead.message.contains("10m ahead of"), "{}", ahead.message);
        let behind = check(Some(&header(-3600)), local, bound);
        assert!(behind.message.contains("1h behind"), "{}", behind.message);
        assert_eq!(check(None, local, bound).status, Status::Warn);
        assert_eq!(check(Some("soon"), local, bound).status, Status::Warn);
    }
}
