// Must not compile: kvpolicy under C++17. The first error is config.hpp's, which says
// that C++20 is needed and how to ask for it (tests/CMakeLists.txt checks the text).
#include "kvpolicy/kvpolicy.hpp"

int main() { return 0; }
