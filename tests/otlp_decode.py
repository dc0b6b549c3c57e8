"""Decodes an OTLP ExportProfilesServiceRequest (protobuf, from the file named by argv[1], or
stdin) with the OpenTelemetry project's own definitions (PyPI's opentelemetry-proto), and prints
what memtrace's tests compare as JSON: per resource, its attributes and, per profile, its sample
type, period and samples, each sample's stack as function names (leaf first) and its value."""

import json
import sys

from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)


def any_value(value):
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def main():
    data = open(sys.argv[1], "rb").read() if len(sys.argv) > 1 else sys.stdin.buffer.read()
    request = ExportProfilesServiceRequest()
    request.ParseFromString(data)
    d = request.dictionary
    strings = list(d.string_table)

    def frames(stack_index):
        names = []
        for location_index in d.stack_table[stack_index].location_indices:
            location = d.location_table[location_index]
            function = d.function_table[location.lines[0].function_index]
            names.append(strings[function.name_strindex])
        return names

    def value_type(v):
        return [strings[v.type_strindex], strings[v.unit_strindex]]

    resources = []
    for resource_profiles in request.resource_profiles:
        attributes = {kv.key: any_value(kv.value) for kv in resource_profiles.resource.attributes}
        profiles = []
        for scope in resource_profiles.scope_profiles:
            for profile in scope.profiles:
                profiles.append({
                    "scope": scope.scope.name,
                    "sample_type": value_type(profile.sample_type),
                    "period_type": value_type(profile.period_type),
                    "period": profile.period,
                    "time_unix_nano": profile.time_unix_nano,
                    "duration_nano": profile.duration_nano,
                    "attributes": {
                        strings[d.attribute_table[i].key_strindex]: any_value(d.attribute_table[i].value)
                        for i in profile.attribute_indices
                    },
                    "samples": [{"stack": frames(s.stack_index), "values": list(s.values)} for s in profile.samples],
                })
        resources.append({"attributes": attributes, "profiles": profiles})
    zeros = {
        "string": strings[0] == "",
        "mapping": d.mapping_table[0].ByteSize() == 0,
        "location": d.location_table[0].ByteSize() == 0,
        "function": d.function_table[0].ByteSize() == 0,
        "stack": d.stack_table[0].ByteSize() == 0,
        "attribute": d.attribute_table[0].ByteSize() == 0,
    }
    # Every byte was a field these definitions know: encoded again, the request is as long.
    known = len(request.SerializeToString()) == len(data)
    print(json.dumps({"resources": resources, "zeros": zeros, "all_fields_known": known}))


main()
