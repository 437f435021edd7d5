// `none`: the stage that is not wanted. Any pipeline slot may hold it.
#pragma once

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// As a scorer: every score 0 (position-only policies). As an aggregator or a
// redundancy: scores pass through. As a selector: every token kept. As a layout:
// keep masks are produced and nothing moves.
struct none {
  friend constexpr bool operator==(none, none) noexcept { return true; }
};

KVP_NAMESPACE_END
