# Fails unless README.md contains examples/basic_usage.cpp verbatim as a ```cpp block,
# so the README's complete example is the one the test suite compiles and runs.
file(READ ${SOURCE_DIR}/README.md readme)
file(READ ${SOURCE_DIR}/examples/basic_usage.cpp example)
# The README shows the program without its two header comment lines.
string(REGEX REPLACE "^// [^\n]*\n// [^\n]*\n" "" body "${example}")
string(FIND "${readme}" "```cpp\n${body}```" at)
if(at EQUAL -1)
  message(FATAL_ERROR "README.md does not contain examples/basic_usage.cpp (minus its 2 comment lines) verbatim")
endif()
