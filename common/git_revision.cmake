# Build-time step of arfuse_core: writes OUT (git_revision.h) with the source tree's short commit,
# so --version names the commit the binary was built from, not the one CMake last configured at.
# The file is rewritten only when the commit changes, so only version.cc recompiles then.
# -DSOURCE_DIR=<repository> -DOUT=<header>. Without git or .git (image builds): the
# ARFUSE_GIT_REVISION environment variable, else "unknown".
execute_process(COMMAND git rev-parse --short HEAD WORKING_DIRECTORY ${SOURCE_DIR}
                OUTPUT_VARIABLE rev OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT rev)
  set(rev "$ENV{ARFUSE_GIT_REVISION}")
endif()
if(NOT rev)
  set(rev unknown)
endif()
set(content "// Generated at build time by common/git_revision.cmake.\n#pragma once\n#define ARFUSE_GIT_REVISION \"${rev}\"\n")
if(EXISTS ${OUT})
  file(READ ${OUT} old)
endif()
if(NOT "${old}" STREQUAL "${content}")
  file(WRITE ${OUT} "${content}")
endif()
