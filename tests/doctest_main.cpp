// The one doctest main shared by kvpolicy_tests (tests/unit/*.cpp) and
// kvpolicy_gpu_tests (tests/gpu/*.cu).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
