// Two aggregators applied in order: Zipage's global score, then pooling.
#pragma once

#include "kvpolicy/config.hpp"

KVP_NAMESPACE_BEGIN
namespace aggregate {

template <class First, class Second>
struct then {
  First first{};
  Second second{};
};

template <class First, class Second>
then(First, Second) -> then<First, Second>;

}  // namespace aggregate
KVP_NAMESPACE_END
