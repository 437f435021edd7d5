// The reductions an attention scorer names: over the GQA group, then over the window.
#pragma once

#include <cstdint>

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN

// Over the G query heads of one KV head.
enum class group_reduce : std::uint8_t {
  max,         // max of probabilities (Zipage, G-KV)
  mean,        // SnapKV
  sum,         // KV-Compress eq. 10
  max_logits,  // max of raw logits over the group, then one softmax (R-KV eq. 3)
};

// Over the w observation queries.
enum class window_reduce : std::uint8_t { mean, sum };

KVP_NAMESPACE_END
