// Links every CUDA header-test object (one TU per .hpp and .cuh under include/kvpolicy):
// a header that defines a non-inline function or kernel fails here with a duplicate
// symbol. Calls no CUDA API, so it runs on a machine without a GPU.
int main() { return 0; }
