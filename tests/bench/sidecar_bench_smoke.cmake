# ctest driver of arfuse_bench_sidecar_host: runs `arfuse-bench sidecar` in host mode and passes
# when it exits 0, prints the table with the echo, eager and inproc rows of every shape and a
# progress line per row on stderr, and writes its JSON.
# -DBENCH=<arfuse-bench> -DARFUSED=<arfused> -DJSON=<output path>
execute_process(
  COMMAND ${BENCH} sidecar --device=host --ranks=2 --tokens=1,16 --hidden=1024 --iters=50
          --warmup=10 --timeout=50 --json=${JSON} --arfused=${ARFUSED}
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err
  TIMEOUT 55)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "arfuse-bench sidecar exited with ${rc}:\n${err}")
endif()
foreach(tokens 1 16)
  foreach(row echo eager inproc)
    if(NOT out MATCHES "\\| ${tokens} \\| 1024 \\| ${row} \\|[^|\n]*\\| [0-9]+\\.[0-9] \\|")
      message(FATAL_ERROR "the table has no measured ${row} row for ${tokens}x1024")
    endif()
  endforeach()
endforeach()
# Progress: one stderr line per row as it finishes.
foreach(tokens 1 16)
  if(NOT err MATCHES "arfuse-bench sidecar: ${tokens} x 1024 eager +p50 [0-9.]+ us")
    message(FATAL_ERROR "no progress line for the eager row of ${tokens}x1024 on stderr:\n${err}")
  endif()
endforeach()
if(NOT out MATCHES "target eager_p50_over_echo_p50")
  message(FATAL_ERROR "the table has no eager-vs-echo line")
endif()
if(NOT EXISTS ${JSON})
  message(FATAL_ERROR "no JSON written to ${JSON}")
endif()
