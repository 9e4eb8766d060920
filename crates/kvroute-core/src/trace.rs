//! TODO(policies helper): trace
