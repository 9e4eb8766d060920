//! TODO(policies helper): cascade
