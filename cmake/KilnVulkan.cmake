# Decides whether the Vulkan compute backend is built (KILN_VULKAN=AUTO|ON|OFF). Sets
# KILN_HAVE_VULKAN (0/1), KILN_VULKAN_INCLUDE_DIR and KILN_GLSLC.
#
# What the build needs: the Vulkan headers (libvulkan-dev) and glslc (glslc), which
# compiles the shaders in src/backend/vulkan/shaders/ to SPIR-V that is embedded in the
# library. What it does not need: the loader. libkiln opens libvulkan.so.1 with dlopen at
# run time, so the same libkiln.so runs on a machine without Vulkan (the backend then says
# "not available: no Vulkan loader (install libvulkan1)") and nothing links -lvulkan.

set(KILN_HAVE_VULKAN 0)
set(KILN_VULKAN_INCLUDE_DIR "")
set(KILN_GLSLC "")

string(TOUPPER "${KILN_VULKAN}" _kiln_vk_mode)
if(NOT _kiln_vk_mode MATCHES "^(AUTO|ON|OFF|TRUE|FALSE|YES|NO|1|0)$")
  message(FATAL_ERROR "kiln: KILN_VULKAN must be AUTO, ON or OFF (got '${KILN_VULKAN}')")
endif()
if(_kiln_vk_mode MATCHES "^(TRUE|YES|1)$")
  set(_kiln_vk_mode ON)
elseif(_kiln_vk_mode MATCHES "^(FALSE|NO|0)$")
  set(_kiln_vk_mode OFF)
endif()

if(NOT _kiln_vk_mode STREQUAL "OFF")
  find_path(KILN_VULKAN_HEADER_DIR vulkan/vulkan.h
            HINTS ENV VULKAN_SDK PATH_SUFFIXES include)
  find_program(KILN_GLSLC_PROGRAM glslc HINTS ENV VULKAN_SDK PATH_SUFFIXES bin)
  set(_kiln_vk_missing "")
  if(NOT KILN_VULKAN_HEADER_DIR)
    list(APPEND _kiln_vk_missing "the Vulkan headers (apt install libvulkan-dev)")
  else()
    # bufferDeviceAddress and friends need the 1.2 headers
    file(STRINGS "${KILN_VULKAN_HEADER_DIR}/vulkan/vulkan_core.h" _kiln_vk_hdr
         REGEX "^#define VK_HEADER_VERSION ")
    if(NOT _kiln_vk_hdr MATCHES "VK_HEADER_VERSION ([0-9]+)" OR CMAKE_MATCH_1 LESS 131)
      list(APPEND _kiln_vk_missing "Vulkan headers of version 1.2 or newer")
    endif()
  endif()
  # KILN_VULKAN_SPIRV_C: the embedded shaders of another build (its
  # build/generated/vk_spirv.c), used when given (glslc is then not run): for a machine
  # with the headers but no glslc (the lent GPU machine). It must come from the same
  # source tree.
  set(KILN_VULKAN_SPIRV_C "" CACHE FILEPATH "A generated vk_spirv.c to use instead of running glslc")
  if(NOT KILN_GLSLC_PROGRAM AND NOT (KILN_VULKAN_SPIRV_C AND EXISTS "${KILN_VULKAN_SPIRV_C}"))
    list(APPEND _kiln_vk_missing "glslc (apt install glslc, or the Vulkan SDK)")
  endif()
  if(NOT _kiln_vk_missing)
    set(KILN_HAVE_VULKAN 1)
    set(KILN_VULKAN_INCLUDE_DIR "${KILN_VULKAN_HEADER_DIR}")
    if(KILN_GLSLC_PROGRAM)
      set(KILN_GLSLC "${KILN_GLSLC_PROGRAM}")
    endif()
    message(STATUS "kiln: Vulkan backend on (glslc ${KILN_GLSLC}; the loader is opened at run time)")
  elseif(_kiln_vk_mode STREQUAL "ON")
    string(REPLACE ";" ", " _kiln_vk_missing "${_kiln_vk_missing}")
    message(FATAL_ERROR "kiln: KILN_VULKAN=ON but missing: ${_kiln_vk_missing} (or use KILN_VULKAN=OFF)")
  else()
    string(REPLACE ";" ", " _kiln_vk_missing "${_kiln_vk_missing}")
    message(STATUS "kiln: Vulkan backend off (missing ${_kiln_vk_missing}; KILN_VULKAN=AUTO)")
  endif()
else()
  message(STATUS "kiln: Vulkan backend off (KILN_VULKAN=OFF)")
endif()

# kiln_vulkan_shaders(<out_c> <shader_dir>): compiles every <shader_dir>/*.comp with glslc
# to SPIR-V and writes <out_c>, a C file that embeds them all (cmake/embed_spirv.cmake), so
# the library finds no shader file at run time. *.glsl files there are #include'd pieces.
function(kiln_vulkan_shaders out_c shader_dir)
  if(KILN_VULKAN_SPIRV_C AND EXISTS "${KILN_VULKAN_SPIRV_C}")
    configure_file("${KILN_VULKAN_SPIRV_C}" "${out_c}" COPYONLY)
    message(STATUS "kiln: Vulkan shaders from ${KILN_VULKAN_SPIRV_C} (glslc not run)")
    return()
  endif()
  file(GLOB _comps CONFIGURE_DEPENDS "${shader_dir}/*.comp")
  file(GLOB _incs CONFIGURE_DEPENDS "${shader_dir}/*.glsl")
  list(SORT _comps)
  set(_spvs "")
  set(_spv_dir "${CMAKE_BINARY_DIR}/generated/spirv")
  file(MAKE_DIRECTORY "${_spv_dir}")
  foreach(_c IN LISTS _comps)
    get_filename_component(_n "${_c}" NAME_WE)
    set(_spv "${_spv_dir}/${_n}.spv")
    add_custom_command(OUTPUT "${_spv}"
      COMMAND "${KILN_GLSLC}" --target-env=vulkan1.2 -O -Werror -I "${shader_dir}"
              -o "${_spv}" "${_c}"
      DEPENDS "${_c}" ${_incs}
      COMMENT "glslc ${_n}.comp"
      VERBATIM)
    list(APPEND _spvs "${_spv}")
  endforeach()
  add_custom_command(OUTPUT "${out_c}"
    COMMAND "${CMAKE_COMMAND}" "-DOUT=${out_c}" "-DSPVS=${_spvs}"
            -P "${PROJECT_SOURCE_DIR}/cmake/embed_spirv.cmake"
    DEPENDS ${_spvs} "${PROJECT_SOURCE_DIR}/cmake/embed_spirv.cmake"
    COMMENT "Embedding the SPIR-V shaders"
    VERBATIM)
endfunction()
