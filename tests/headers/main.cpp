// Links every C++ header-test object (one TU per header under include/kvpolicy):
// a header that defines a non-inline function fails here with a duplicate symbol.
int main() { return 0; }
