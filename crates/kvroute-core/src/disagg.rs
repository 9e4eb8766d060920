//! TODO(policies helper): disagg
