# cmake -DREADME=README.md -DOUT=readme_example.c -P extract_readme_example.cmake
# Writes the ```c block that follows the line `<!-- example:main -->` in README.md to
# OUT, with a #line directive so compiler messages point into README.md.
# file(READ) + string(FIND) rather than file(STRINGS): C is full of ';', CMake's list
# separator.
if(NOT README OR NOT OUT)
  message(FATAL_ERROR "usage: cmake -DREADME=... -DOUT=... -P extract_readme_example.cmake")
endif()
file(READ "${README}" _text)
string(FIND "${_text}" "<!-- example:main -->" _mark)
if(_mark LESS 0)
  message(FATAL_ERROR "${README}: no line '<!-- example:main -->'")
endif()
string(SUBSTRING "${_text}" ${_mark} -1 _rest)
string(FIND "${_rest}" "```c\n" _open)
if(_open LESS 0)
  message(FATAL_ERROR "${README}: no ```c block after '<!-- example:main -->'")
endif()
math(EXPR _body_at "${_open} + 5")
string(SUBSTRING "${_rest}" ${_body_at} -1 _body)
string(FIND "${_body}" "\n```" _close)
if(_close LESS 0)
  message(FATAL_ERROR "${README}: the example's ```c block is not closed")
endif()
math(EXPR _close "${_close} + 1")
string(SUBSTRING "${_body}" 0 ${_close} _code)
# Line number of the block's first line in README.md.
math(EXPR _abs "${_mark} + ${_body_at}")
string(SUBSTRING "${_text}" 0 ${_abs} _before)
string(REGEX REPLACE "[^\n]" "" _newlines "${_before}")
string(LENGTH "${_newlines}" _line)
math(EXPR _line "${_line} + 1")
file(WRITE "${OUT}" "#line ${_line} \"${README}\"\n${_code}")
