# Metal backend on Apple platforms. Meant to be include()d by the top-level CMakeLists.txt inside
# `if(APPLE AND LILY_METAL)`, after csrc/metal/metal_sources.cmake (the kernel sources embedded as text);
# it defines the static library lily_metal (link it into _lily and define LILY_HAVE_METAL=1 there).
# Not run yet: no Apple machine was available (docs/metal.md).
#
# The kernels need no build-time compiler (issue 16): the extension carries metal/*.metal as text and the
# device compiles it at first use (MTLDevice newLibraryWithSource, device_mtl.mm), so `pip install .` needs
# only Apple clang (the Command Line Tools). Only when Xcode's Metal toolchain is installed and compiles
# every file does this also build lily.metallib (and lily_tensor.metallib, -std=metal4.0, for the Metal 4
# tensor-op GEMMs), which the device then prefers. Those compiles run at configure time and are allowed to
# fail: a missing toolchain or a diagnostic from Apple's compiler is a warning here and the runtime compile
# takes over; it never fails the install. Changing a .metal file re-runs the configure step.
enable_language(OBJCXX ASM)

option(LILY_METAL_PRECOMPILE "Also build lily.metallib at build time when Xcode's Metal toolchain is present" ON)

file(GLOB LILY_METAL_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/metal/*.metal)
set(LILY_METAL_TENSOR_SOURCE ${CMAKE_CURRENT_SOURCE_DIR}/metal/gemm_tensor.metal)
list(REMOVE_ITEM LILY_METAL_SOURCES ${LILY_METAL_TENSOR_SOURCE})
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${LILY_METAL_EMBED_ABS})
set(LILY_METAL_OUT ${CMAKE_CURRENT_BINARY_DIR}/metal)
file(MAKE_DIRECTORY ${LILY_METAL_OUT})
set(LILY_METAL_FLAGS -Wall -Wextra -fno-fast-math -I ${CMAKE_CURRENT_SOURCE_DIR}/metal -I ${CMAKE_CURRENT_SOURCE_DIR}/csrc)

# Compiles `sources` with `std` into `metallib`; sets `ok_var` to TRUE on success, else FALSE with a warning
# that carries the compiler's output.
function(lily_try_metallib sources std metallib ok_var)
  set(airs "")
  foreach(src ${sources})
    get_filename_component(stem ${src} NAME_WE)
    set(air ${LILY_METAL_OUT}/${stem}.air)
    execute_process(COMMAND xcrun -sdk macosx metal -std=${std} ${LILY_METAL_FLAGS} -c ${src} -o ${air}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
    if(NOT rc EQUAL 0)
      message(WARNING "lily: xcrun metal could not compile ${stem}.metal (-std=${std}); the extension will "
                      "compile the embedded sources at first use instead. The compiler said:\n${out}")
      set(${ok_var} FALSE PARENT_SCOPE)
      return()
    endif()
    list(APPEND airs ${air})
  endforeach()
  execute_process(COMMAND xcrun -sdk macosx metallib ${airs} -o ${metallib}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(WARNING "lily: xcrun metallib failed; the runtime compile takes over:\n${out}")
    set(${ok_var} FALSE PARENT_SCOPE)
    return()
  endif()
  set(${ok_var} TRUE PARENT_SCOPE)
endfunction()

# An assembler file that embeds `file` as <symbol> / <symbol>_size (size 0 and one zero byte without it).
function(lily_embed_blob symbol file asm)
  if(file)
    set(data ".incbin \"${file}\"\n")
  else()
    set(data ".byte 0\n")
  endif()
  file(WRITE ${asm}
    ".section __DATA,__const\n.globl _${symbol}\n.globl _${symbol}_size\n"
    ".p2align 4\n_${symbol}:\n${data}_${symbol}_end:\n"
    ".p2align 3\n_${symbol}_size:\n.quad ${${symbol}_size_expr}\n")
endfunction()

# Is there a Metal toolchain? The Command Line Tools alone have none (`xcrun metal` fails or asks for the
# separately downloaded Metal toolchain); a probe compile answers for every case.
set(LILY_METALLIB "")
set(LILY_TENSOR_METALLIB "")
if(LILY_METAL_PRECOMPILE)
  set(probe ${LILY_METAL_OUT}/probe.metal)
  file(WRITE ${probe} "#include <metal_stdlib>\nkernel void lily_probe(device float* y [[buffer(0)]]) { y[0] = 0.0f; }\n")
  execute_process(COMMAND xcrun -sdk macosx metal -std=metal3.0 -c ${probe} -o ${probe}.air
                  RESULT_VARIABLE probe_rc OUTPUT_QUIET ERROR_QUIET)
  if(probe_rc EQUAL 0)
    lily_try_metallib("${LILY_METAL_SOURCES}" metal3.0 ${CMAKE_CURRENT_BINARY_DIR}/lily.metallib main_ok)
    if(main_ok)
      set(LILY_METALLIB ${CMAKE_CURRENT_BINARY_DIR}/lily.metallib)
      message(STATUS "lily: Metal toolchain found, lily.metallib built (the runtime compile stays the fallback)")
      execute_process(COMMAND xcrun -sdk macosx metal -std=metal4.0 -c ${probe} -o ${probe}4.air
                      RESULT_VARIABLE probe4_rc OUTPUT_QUIET ERROR_QUIET)
      if(probe4_rc EQUAL 0)
        lily_try_metallib("${LILY_METAL_TENSOR_SOURCE}" metal4.0 ${CMAKE_CURRENT_BINARY_DIR}/lily_tensor.metallib
                          tensor_ok)
        if(tensor_ok)
          set(LILY_TENSOR_METALLIB ${CMAKE_CURRENT_BINARY_DIR}/lily_tensor.metallib)
        endif()
      endif()
    endif()
  else()
    message(STATUS "lily: no Metal toolchain (Command Line Tools only?): the kernels are compiled from the "
                   "embedded sources at first use")
  endif()
endif()

set(lily_metallib_size_expr "_lily_metallib_end - _lily_metallib")
set(lily_tensor_metallib_size_expr "_lily_tensor_metallib_end - _lily_tensor_metallib")
if(NOT LILY_METALLIB)
  set(lily_metallib_size_expr 0)
endif()
if(NOT LILY_TENSOR_METALLIB)
  set(lily_tensor_metallib_size_expr 0)
endif()
lily_embed_blob(lily_metallib "${LILY_METALLIB}" ${CMAKE_CURRENT_BINARY_DIR}/lily_metallib.s)
lily_embed_blob(lily_tensor_metallib "${LILY_TENSOR_METALLIB}" ${CMAKE_CURRENT_BINARY_DIR}/lily_tensor_metallib.s)
set_source_files_properties(${CMAKE_CURRENT_BINARY_DIR}/lily_metallib.s ${CMAKE_CURRENT_BINARY_DIR}/lily_tensor_metallib.s
                            PROPERTIES OBJECT_DEPENDS "${LILY_METALLIB};${LILY_TENSOR_METALLIB}")

add_library(lily_metal STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/csrc/metal/device_mtl.mm
  ${CMAKE_CURRENT_SOURCE_DIR}/csrc/metal/kernel_sources.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/csrc/metal/ops_metal.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/csrc/metal/sampler_metal.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/csrc/metal/backend_metal.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/csrc/metal/backend_options.cpp
  ${LILY_METAL_EMBEDDED_CPP}
  ${CMAKE_CURRENT_BINARY_DIR}/lily_metallib.s
  ${CMAKE_CURRENT_BINARY_DIR}/lily_tensor_metallib.s)
target_include_directories(lily_metal PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/csrc)
target_compile_definitions(lily_metal PRIVATE LILY_METAL_APPLE=1)
target_compile_options(lily_metal PRIVATE $<$<COMPILE_LANGUAGE:OBJCXX>:-fobjc-arc>
                       $<$<COMPILE_LANGUAGE:CXX,OBJCXX>:-Werror=overloaded-virtual>)
target_link_libraries(lily_metal PUBLIC lily_core "-framework Metal" "-framework Foundation")
