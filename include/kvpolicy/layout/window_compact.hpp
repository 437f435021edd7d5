// Kara 4.3: compaction of the window alone.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"
#include "kvpolicy/layout/compact.hpp"

KVP_NAMESPACE_BEGIN
namespace layout {

// compact over [window_begin, T) of each batch item (batch_item::window_begin, a
// multiple of the block size): the window's kept tokens and the tokens after it move
// down in order, with F and positions; the blocks past the new length are released.
// Nothing before window_begin is read or written, so context compressed at earlier
// windows (or shared with other requests) is left as it is.
struct window_compact : compact {
  static constexpr bool window_only = true;
};

}  // namespace layout
KVP_NAMESPACE_END
